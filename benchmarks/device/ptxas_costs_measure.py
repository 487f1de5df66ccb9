"""ptxas CPU-s per PTX module on the lent machine (the source of sm121_build/data/ptxas_costs.json):
each child's CPU (user+sys) and peak RSS by os.wait4, wall by monotonic clock; N at a time,
largest first (--phases all), then the largest modules alone plain and with --split-compile 4
and 15, their .text compared (--phases split).  Inputs: benchmarks/aot_costs_extract.py's PTX
and a jobs file ({"jobs": [{digest, arch, options, ptx_bytes}], "split": [...]})."""
import argparse, hashlib, json, os, struct, subprocess, sys, time

def spawn(argv, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fa = [(os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2), (os.POSIX_SPAWN_CLOSE, fd)]
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=fa)
    os.close(fd)
    return pid

def sections(path):
    d = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stro, strs = hdrs[shstrndx][4], hdrs[shstrndx][5]
    strtab = d[stro:stro + strs]
    out = {}
    for name, typ, flags, addr, off, size in hdrs:
        n = strtab[name:strtab.index(b"\0", name)].decode()
        out[n] = b"" if typ == 8 else d[off:off + size]
    return d, out

def run_pool(jobs, ptxas, ptxdir, cubdir, logdir, n, res, extra=()):
    pending = list(jobs); running = {}
    fout = open(res, "a")
    while pending or running:
        while pending and len(running) < n:
            j = pending.pop(0)
            cub = os.path.join(cubdir, j["digest"] + ".cubin")
            argv = [ptxas, f"-arch={j['arch']}", *j["options"], *extra, "-o", cub,
                    os.path.join(ptxdir, j["digest"] + ".ptx")]
            pid = spawn(argv, os.path.join(logdir, j["digest"] + ".log"))
            running[pid] = (j, time.monotonic(), argv, cub)
        pid, status, ru = os.wait4(-1, 0)
        j, t0, argv, cub = running.pop(pid)
        wall = time.monotonic() - t0
        r = dict(digest=j["digest"], arch=j["arch"], options=j["options"], ptx_bytes=j["ptx_bytes"],
                 argv=argv[1:-3] , rc=os.waitstatus_to_exitcode(status),
                 cpu_seconds=ru.ru_utime + ru.ru_stime, user=ru.ru_utime, sys=ru.ru_stime,
                 wall_seconds=wall, max_rss_bytes=ru.ru_maxrss * 1024,
                 cubin_bytes=os.path.getsize(cub) if os.path.exists(cub) else None,
                 parallel=n)
        fout.write(json.dumps(r) + "\n"); fout.flush()
        print(f"{r['rc']} {r['cpu_seconds']:8.1f} {wall:8.1f} {r['max_rss_bytes']>>20:6d}M {j['ptx_bytes']>>20:4d}M {j['digest'][:10]}", flush=True)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptxas", required=True); ap.add_argument("--ptxdir", required=True)
    ap.add_argument("--work", required=True); ap.add_argument("--jobs", required=True)
    ap.add_argument("-n", type=int, default=16); ap.add_argument("--phases", default="all,split")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    spec = json.load(open(a.jobs))
    os.makedirs(a.work, exist_ok=True)
    env = dict(ptxas_version=subprocess.run([a.ptxas, "--version"], capture_output=True, text=True).stdout,
               lscpu=subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
               nproc=os.cpu_count(), affinity=len(os.sched_getaffinity(0)), uname=os.uname().release,
               meminfo=open("/proc/meminfo").read().split("\n")[0])
    json.dump(env, open(os.path.join(a.work, "env.json"), "w"), indent=1)
    phases = a.phases.split(",")
    if "all" in phases:
        for d in ("cub", "log"): os.makedirs(os.path.join(a.work, d), exist_ok=True)
        jobs = spec["jobs"]
        if a.only:
            keep = a.only.split(","); jobs = [j for j in jobs if j["digest"] in keep]
        t = time.monotonic()
        run_pool(jobs, a.ptxas, a.ptxdir, os.path.join(a.work, "cub"), os.path.join(a.work, "log"), a.n,
                 os.path.join(a.work, "all.jsonl"))
        open(os.path.join(a.work, "all.done"), "w").write(str(time.monotonic() - t))
    if "split" in phases:
        rows = []
        for s in spec["split"]:
            base = None
            for mode, extra in (("plain", ()), ("split4", ("--split-compile=4",)), ("split15", ("--split-compile=15",))):
                cd = os.path.join(a.work, "split_" + mode); os.makedirs(cd, exist_ok=True)
                res = os.path.join(a.work, "split_tmp.jsonl")
                if os.path.exists(res): os.remove(res)
                run_pool([s], a.ptxas, a.ptxdir, cd, cd, 1, res, extra)
                r = json.loads(open(res).read().splitlines()[-1])
                r.update(mode=mode, platform=s["platform"], file=s["file"], container=s["container"])
                whole, secs = sections(os.path.join(cd, s["digest"] + ".cubin"))
                text = {k: hashlib.sha256(v).hexdigest() for k, v in secs.items() if k.startswith(".text")}
                r["text_sections"] = len(text); r["text_bytes"] = sum(len(v) for k, v in secs.items() if k.startswith(".text"))
                r["cubin_sha256"] = hashlib.sha256(whole).hexdigest()
                if mode == "plain":
                    base = (text, secs, r["cubin_sha256"])
                else:
                    r["text_identical_to_plain"] = text == base[0]
                    r["text_sections_differing"] = sorted(k for k in set(text) | set(base[0]) if text.get(k) != base[0].get(k))[:20]
                    r["n_text_sections_differing"] = len([k for k in set(text) | set(base[0]) if text.get(k) != base[0].get(k)])
                    r["all_sections_identical"] = {k: hashlib.sha256(v).hexdigest() for k, v in secs.items()} == {k: hashlib.sha256(v).hexdigest() for k, v in base[1].items()}
                    r["sections_differing"] = sorted(k for k in set(secs) | set(base[1]) if secs.get(k) != base[1].get(k))[:20]
                    r["cubin_identical"] = r["cubin_sha256"] == base[2]
                rows.append(r)
                json.dump(rows, open(os.path.join(a.work, "split.json"), "w"), indent=1)
        open(os.path.join(a.work, "split.done"), "w").write("ok")

main()
