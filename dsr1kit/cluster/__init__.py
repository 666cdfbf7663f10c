"""Pre-flight of a Slurm allocation (notebook 00_cluster_check, slurm/cluster_check.sbatch).

checks.py      Row, node-local checks (packages, GPUs, /dev/shm, scratch), gathering and verdict
slurm.py       the job from SLURM_* and scontrol: node list, rendezvous, node IP, --gpus-per-task trap
net.py         the interface NCCL/Gloo use, the IP Ray/vLLM advertise, host-name resolution
allreduce.py   an all-reduce across all ranks: exact sums and bus bandwidth
rank_check.py  the per-rank entry point (`srun python -m dsr1kit.cluster.rank_check`), local ranks
ray.py         Ray bring-up through slurm/ray_cluster.sh, wait for every node, state, scoped stop
"""
