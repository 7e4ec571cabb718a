"""`python -m gpu.kernels.cpu`: build every C++ CPU kernel now (in parallel, one compiler
process each), so that the first engine start — or the first test — does not wait for
them. Already-built kernels load from the cache at once. Exits 0 even where a kernel does
not build: the engine then runs its torch code (see `load`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpu.kernels import cpu


def main() -> None:
    if cpu.switched_off():
        print("C++ CPU kernels switched off (TIERSERVE_CPU_KERNELS=off): the engine runs torch ops", flush=True)
        return
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import sys; from gpu.kernels import cpu; sys.exit(0 if cpu.load(sys.argv[1]) else 1)"
    names = cpu.names()
    print(f"building C++ CPU kernels: {', '.join(names)} (cached under {cpu.cache_dir()})", flush=True)
    jobs = {n: subprocess.Popen([sys.executable, "-c", code, n], env=env) for n in names}
    failed = [n for n, job in jobs.items() if job.wait() != 0]
    took = time.perf_counter() - started
    if failed:
        print(f"not built: {', '.join(failed)} (the engine runs torch ops instead); {took:.0f} s", flush=True)
    else:
        print(f"all {len(names)} kernels ready in {took:.0f} s", flush=True)


if __name__ == "__main__":
    main()
