"""Evaluation throughput: the kit's async client against a vLLM server vs vLLM's offline LLM.generate.

    python -m bench.eval_throughput [--model tiny] [--repeat 4] [--max-new-tokens 64] [--max-num-seqs 32]
                                    [--concurrency 64] [--rounds 3]

The same prompts (the eval set's chat prompts, as token ids, repeated), the same
engine settings, greedy decoding with ``ignore_eos`` so both sides generate
exactly ``max_new_tokens`` per prompt. Offline runs in a subprocess (its own
engine, shut down before the server starts); each side gets a short warm-up
first. The two sides alternate for ``--rounds`` rounds (a shared machine's speed
drifts by 30% between minutes); prints each round and the median of the
online/offline ratios. Target >= 0.9, i.e. the HTTP + client path costs under 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, max_num_batched_tokens=4096)


def prompts_ids(model_path: str, repeat: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dsr1kit.infer import evaluate as ev

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = ev.build_prompts(ev.load_rows("data/eval_tiny.jsonl"), tok, "You are DeepSeek-R1.")
    return [p.token_ids for p in prompts] * repeat


def offline(model_path: str, ids: list[list[int]], max_new: int, max_num_seqs: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_path, max_num_seqs=max_num_seqs, seed=0, **ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids[:8]], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall}


def online(
    model_path: str, ids: list[list[int]], max_new: int, max_num_seqs: int, env: dict, concurrency: int
) -> dict:
    from dsr1kit.cluster.rendezvous import free_port
    from dsr1kit.infer.client import CompletionClient, Request
    from dsr1kit.infer.server import ServerSpec, VLLMServer

    spec = ServerSpec(
        model=model_path, port=free_port(), max_num_seqs=max_num_seqs, seed=0, env=env, **ENGINE
    )
    with tempfile.TemporaryDirectory() as tmp, VLLMServer(spec, Path(tmp) / "server.log", 300) as server:
        client = CompletionClient(server.base_url, spec.served_model_name, concurrency=concurrency)
        kw = dict(max_tokens=max_new, extra={"ignore_eos": True})
        client.complete([Request(f"w{i}", x) for i, x in enumerate(ids[:8])], Path(tmp) / "warm.jsonl", **kw)
        stats = client.complete(
            [Request(str(i), x) for i, x in enumerate(ids)], Path(tmp) / "run.jsonl", **kw
        )
    return {
        "wall_s": stats.wall_s,
        "completion_tokens": stats.completion_tokens,
        "tokens_per_s": stats.tokens_per_s,
        **{k: v for k, v in stats.summary().items() if "latency" in k},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeat", type=int, default=4, help="the 96 eval prompts, this many times")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="engine batch")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="client requests in flight (default 2 x max-num-seqs: a queue in the engine, so a "
        "finished sequence's slot is refilled in the next step, not after an HTTP round trip)",
    )
    ap.add_argument(
        "--omp-bind",
        default="",
        help="VLLM_CPU_OMP_THREADS_BIND for both engines, e.g. '1' "
        "to leave core 0 to the API server and the client (default: vLLM's own choice)",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="offline/online pairs; the median ratio is reported"
    )
    ap.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from dsr1kit.embedded.tiny import resolve_model

    model_path = resolve_model(args.model)
    ids = prompts_ids(model_path, args.repeat)
    if args.offline_only:
        print("RESULT " + json.dumps(offline(model_path, ids, args.max_new_tokens, args.max_num_seqs)))
        return 0
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **({"VLLM_CPU_OMP_THREADS_BIND": args.omp_bind} if args.omp_bind else {}),
    }

    concurrency = args.concurrency or 2 * args.max_num_seqs
    rounds = []
    for r in range(args.rounds):  # alternate the two sides: a shared machine's speed drifts between minutes
        cmd = [
            sys.executable,
            "-m",
            "bench.eval_throughput",
            "--offline-only",
            "--model",
            args.model,
            "--repeat",
            str(args.repeat),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--max-num-seqs",
            str(args.max_num_seqs),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            return 1
        off = json.loads(line[0][7:])
        on = online(model_path, ids, args.max_new_tokens, args.max_num_seqs, env, concurrency)
        rounds.append({"offline": off, "online": on, "ratio": on["tokens_per_s"] / off["tokens_per_s"]})
        print(
            f"round {r + 1}: offline {off['tokens_per_s']:7.1f} tok/s ({off['wall_s']:.2f} s) | server + kit "
            f"client {on['tokens_per_s']:7.1f} tok/s ({on['wall_s']:.2f} s, p50 {on['latency_p50_s']:.2f} s, "
            f"p90 {on['latency_p90_s']:.2f} s) | ratio {rounds[-1]['ratio']:.3f}",
            flush=True,
        )
    ratio = statistics.median(x["ratio"] for x in rounds)
    result = {
        "prompts": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "max_num_seqs": args.max_num_seqs,
        "omp_bind": args.omp_bind or "vllm default",
        "concurrency": concurrency,
        "rounds": rounds,
        "ratio_median": ratio,
    }
    print(
        f"prompts {len(ids)} x {args.max_new_tokens} new tokens, batch {args.max_num_seqs}, "
        f"client concurrency {concurrency}, {args.rounds} rounds"
    )
    each = ", ".join(f"{x['ratio']:.3f}" for x in rounds)
    print(f"median ratio online/offline : {ratio:.3f}  (target >= 0.9; rounds {each})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
