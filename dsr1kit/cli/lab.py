"""`dsr1kit lab`: JupyterLab on the project with the kit's kernel, its URL and token printed."""

from __future__ import annotations

import argparse
import sys

from ..run.paths import PROJECT_ROOT


def cmd_lab(args: argparse.Namespace) -> int:
    """JupyterLab on the project, the dsr1kit kernel, the notebooks folder open; runs until stopped."""
    import os
    import secrets
    import signal
    import subprocess
    import time
    import urllib.request

    from ..cluster.rendezvous import free_port
    from ..run.report import ensure_kernelspec

    kernel = ensure_kernelspec()  # the kernel runs this venv's Python, whatever Jupyter finds first
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    port = args.port or free_port(args.ip)
    extra = args.jupyter_args[1:] if args.jupyter_args[:1] == ["--"] else args.jupyter_args
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.no_browser_open_file=True",
        f"--ServerApp.root_dir={PROJECT_ROOT}",
        f"--ServerApp.ip={args.ip}",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.default_url=/lab/tree/notebooks",
        f"--MappingKernelManager.default_kernel_name={kernel}",
        *extra,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    # The token travels in the environment (Jupyter reads JUPYTER_TOKEN): not in argv, not in a file.
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**os.environ, "JUPYTER_TOKEN": token})
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    host = f"[{args.ip}]" if ":" in args.ip else args.ip
    base = f"http://{host}:{port}"
    deadline = time.monotonic() + args.timeout
    try:
        while proc.poll() is None:
            try:
                req = urllib.request.Request(
                    f"{base}/api/status", headers={"Authorization": f"token {token}"}
                )
                urllib.request.urlopen(req, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(
                        f"error: JupyterLab did not answer on {base} within {args.timeout:.0f} s",
                        file=sys.stderr,
                    )
                    proc.terminate()
                    break
                time.sleep(0.3)
        if proc.poll() is None:
            print(
                f"\nJupyterLab on {PROJECT_ROOT}, kernel '{kernel}' (this environment). Open:\n\n"
                f"    {base}/lab/tree/notebooks?token={token}\n\n"
                f"Stop with Ctrl-C twice.",
                flush=True,
            )
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # Jupyter got it too: it asks to confirm, a second Ctrl-C stops it
                continue
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
