"""Pre-flight of a Slurm allocation (notebook 00_cluster_check, slurm/cluster_check.sbatch).

rendezvous.py  ranks, node list, host resolution, MASTER_ADDR/PORT, a free port, leaving the process
               group; imports no other module here, so training uses it without the checks
checks.py      Row, node-local checks (packages, GPUs, /dev/shm, scratch), gathering and verdict
slurm.py       the job from SLURM_* and scontrol: layout, its rendezvous, node IP, --gpus-per-task trap
net.py         the interface NCCL/Gloo use, the IP Ray/vLLM advertise, host-name resolution
allreduce.py   an all-reduce across all ranks: exact sums and bus bandwidth
rank_check.py  one rank's checks (RankCheckConfig), run by `srun python -m dsr1kit rank-check` or as local ranks
ray.py         Ray across nodes (started by slurm/ray_cluster.sh): wait for every node, state, scoped stop
"""
