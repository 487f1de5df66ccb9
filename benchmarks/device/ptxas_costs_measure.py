"""ptxas CPU-s per PTX module on the lent machine (the source of
sm121_build/data/ptxas_costs.json): each child's CPU (user+sys) and peak RSS by os.wait4,
wall by the monotonic clock; N at a time, largest first (--phases all), then the largest
modules alone, plain and with --split-compile 4 and 15, their .text compared
(--phases split).  Inputs: benchmarks/aot_costs_extract.py's PTX, and a jobs file
({"jobs": [{digest, arch, options, ptx_bytes}], "split": [{... platform, file,
container}]}).  Standard library only (the lent machine's Python).

    python3 ptxas_costs_measure.py --ptxas PTXAS --ptxdir PTX --work OUT --jobs JOBS.json
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

SPLIT_MODES = (("plain", ()), ("split4", ("--split-compile=4",)),
               ("split15", ("--split-compile=15",)))


def spawn(argv: list[str], log: Path) -> int:
    """Start a process, its output to `log`; its pid."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    actions = [(os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2),
               (os.POSIX_SPAWN_CLOSE, fd)]
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    os.close(fd)
    return pid


def sections(path: Path) -> tuple[bytes, dict[str, bytes]]:
    """A cubin's bytes and its sections by name (ELF64 little-endian)."""
    data = path.read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at, names_size = headers[shstrndx][4], headers[shstrndx][5]
    names = data[names_at:names_at + names_size]
    found = {}
    for name, kind, _flags, _addr, offset, size in headers:
        label = names[name:names.index(b"\0", name)].decode()
        found[label] = b"" if kind == 8 else data[offset:offset + size]  # SHT_NOBITS
    return data, found


def run_pool(jobs: list[dict[str, Any]], where: dict[str, Path], parallel: int,
             extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Compile the jobs `parallel` at a time in the given order; one row per job, appended
    to where['results'] as it ends."""
    pending, running, rows = list(jobs), {}, []
    with open(where["results"], "a") as out:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                cubin = where["cubins"] / f"{job['digest']}.cubin"
                argv = [str(where["ptxas"]), f"-arch={job['arch']}", *job["options"], *extra,
                        "-o", str(cubin), str(where["ptx"] / f"{job['digest']}.ptx")]
                pid = spawn(argv, where["logs"] / f"{job['digest']}.log")
                running[pid] = (job, time.monotonic(), cubin)
            pid, status, usage = os.wait4(-1, 0)
            job, started, cubin = running.pop(pid)
            row = {"digest": job["digest"], "arch": job["arch"], "options": job["options"],
                   "ptx_bytes": job["ptx_bytes"], "extra": list(extra),
                   "rc": os.waitstatus_to_exitcode(status),
                   "cpu_seconds": usage.ru_utime + usage.ru_stime, "user": usage.ru_utime,
                   "sys": usage.ru_stime, "wall_seconds": time.monotonic() - started,
                   "max_rss_bytes": usage.ru_maxrss * 1024, "parallel": parallel,
                   "cubin_bytes": cubin.stat().st_size if cubin.exists() else None}
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
            print(f"{row['rc']} {row['cpu_seconds']:8.1f} {row['wall_seconds']:8.1f} "
                  f"{row['max_rss_bytes'] >> 20:6d}M {job['digest'][:10]}", flush=True)
    return rows


def split_phase(spec: dict[str, Any], where: dict[str, Path]) -> list[dict[str, Any]]:
    """The largest modules alone: plain, split 4 and split 15; the .text of each against
    the plain cubin's."""
    rows = []
    for job in spec["split"]:
        plain: dict[str, bytes] = {}
        for mode, extra in SPLIT_MODES:
            folder = where["work"] / f"split_{mode}"
            folder.mkdir(exist_ok=True)
            row = run_pool([job], {**where, "cubins": folder, "logs": folder,
                                   "results": folder / "rows.jsonl"}, 1, extra)[0]
            _whole, found = sections(folder / f"{job['digest']}.cubin")
            text = {k: v for k, v in found.items() if k.startswith(".text")}
            row.update(mode=mode, platform=job["platform"], file=job["file"],
                       container=job["container"], text_sections=len(text))
            if mode == "plain":
                plain = found
            else:
                row["text_identical_to_plain"] = text == {
                    k: v for k, v in plain.items() if k.startswith(".text")}
                row["sections_differing"] = sorted(
                    k for k in set(found) | set(plain) if found.get(k) != plain.get(k))
            rows.append(row)
            (where["work"] / "split.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ptxas", required=True, type=Path)
    parser.add_argument("--ptxdir", required=True, type=Path)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--jobs", required=True, type=Path)
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--phases", default="all,split")
    args = parser.parse_args()
    spec = json.loads(args.jobs.read_text())
    args.work.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([str(args.ptxas), "--version"], capture_output=True, text=True,
                             check=False).stdout
    (args.work / "env.json").write_text(json.dumps({
        "ptxas_version": version, "nproc": os.cpu_count(),
        "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True,
                                check=False).stdout}, indent=1))
    where = {"ptxas": args.ptxas, "ptx": args.ptxdir, "work": args.work,
             "cubins": args.work / "cub", "logs": args.work / "log",
             "results": args.work / "all.jsonl"}
    phases = args.phases.split(",")
    if "all" in phases:
        where["cubins"].mkdir(exist_ok=True)
        where["logs"].mkdir(exist_ok=True)
        jobs = sorted(spec["jobs"], key=lambda j: -int(j["ptx_bytes"]))
        started = time.monotonic()
        run_pool(jobs, where, args.n)
        (args.work / "all.done").write_text(str(time.monotonic() - started))
    if "split" in phases:
        split_phase(spec, where)


if __name__ == "__main__":
    main()
