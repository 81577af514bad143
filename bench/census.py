"""Where a host's CPU goes while the service is under load: every thread of the given processes, from
/proc/PID/task/TID/stat and status before and after a window, ranked by CPU seconds, with its process's role (the
process name: vitserve-http, vitserve-infer, wrk) and its own name (the service names its threads by job:
service/core/thread_names.py); and the host's own figures over the window from /proc/stat and /proc/interrupts (steal,
iowait, softirq, context switches, interrupts, TLB shootdowns).

    python bench/census.py PID [PID ...] --seconds 5      # those processes and their children, now

bench/gpu_check.py takes one for a /classify and a /v2 level of the service part (`measure`).
"""
import argparse
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
# /proc/stat's cpu line, in its order
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# /proc/interrupts' per-CPU lines summed: the IPIs that many threads of one process over many cores cost
INTERRUPTS = {"TLB": "TLB shootdowns", "CAL": "function calls", "RES": "rescheduling", "LOC": "timer"}


@dataclass(frozen=True)
class Thread:
    role: str  # its process's name
    name: str
    main: bool  # the process's main thread: the event loop, in the service's processes
    user: int  # ticks
    system: int
    faults: int  # minor page faults
    switches: int  # voluntary context switches (it waited)
    preempted: int  # involuntary ones (it was made to wait)

    @property
    def kind(self) -> str:
        """What it is, several alike as one: "event loop", "decode-N"."""
        return "event loop" if self.main and self.role.startswith("vitserve") else re.sub(r"\d+$", "N", self.name)


def children(pid: int) -> list[int]:
    """The process's descendants, depth first."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *children(kid)]
    return found


def _comm(path: Path) -> str:
    return path.read_text().strip()


def threads(pids: list[int]) -> dict[tuple[int, int], Thread]:
    """Each thread of these processes by (pid, tid): what it has spent so far. Gone ones are left out."""
    found = {}
    for pid in pids:
        try:
            role = _comm(Path(f"/proc/{pid}/comm"))
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
                status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
                              if ":\t" in line)
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0]
            found[pid, int(task.name)] = Thread(
                role, stat[stat.index("(") + 1:stat.rindex(")")], int(task.name) == pid, int(fields[11]),
                int(fields[12]), int(fields[7]), int(status.get("voluntary_ctxt_switches", 0)),
                int(status.get("nonvoluntary_ctxt_switches", 0)))
    return found


def host() -> dict[str, int]:
    """The host's counters so far: /proc/stat's CPU ticks by field, context switches, interrupts, and the IPIs of
    /proc/interrupts summed over the CPUs."""
    counters = {}
    for line in Path("/proc/stat").read_text().splitlines():
        key, *values = line.split()
        if key == "cpu":
            counters |= dict(zip(CPU_FIELDS, map(int, values)))
        elif key in ("ctxt", "intr"):
            counters[key] = int(values[0])
    try:
        for line in Path("/proc/interrupts").read_text().splitlines():
            key, _, rest = line.strip().partition(":")
            if key in INTERRUPTS:
                counters[key] = sum(int(v) for v in rest.split() if v.isdigit())
    except OSError:
        pass
    return counters


@dataclass
class Snapshot:
    at: float
    host: dict[str, int]
    threads: dict[tuple[int, int], Thread]


def snapshot(pids: list[int]) -> Snapshot:
    """These processes (with their descendants) and the host, now."""
    every = list(dict.fromkeys(p for pid in pids for p in (pid, *children(pid))))
    return Snapshot(time.monotonic(), host(), threads(every))


def spent(before: Snapshot, after: Snapshot) -> dict[tuple[int, int], Thread]:
    """What each thread alive at the end spent since the start (a Thread of differences; one started in between,
    all of it). A thread that ended in between is not counted."""
    out = {}
    for key, b in after.threads.items():
        a = before.threads.get(key) or Thread(b.role, b.name, b.main, 0, 0, 0, 0, 0)
        out[key] = Thread(b.role, b.name, b.main, b.user - a.user, b.system - a.system, b.faults - a.faults,
                          b.switches - a.switches, b.preempted - a.preempted)
    return out


def _cores(ticks: int, seconds: float) -> float:
    return ticks / TICKS / seconds


def report(before: Snapshot, after: Snapshot, images: float, top: int = 12) -> list[str]:
    """The census as lines: the host, then each role, each kind of thread within it, and the busiest threads; CPU
    as cores (CPU seconds a second) and as ms per image of the `images` done in the window."""
    seconds = after.at - before.at
    d = {k: after.host.get(k, 0) - before.host.get(k, 0) for k in after.host}
    total = sum(d.get(f, 0) for f in CPU_FIELDS) or 1
    ncpu = os.cpu_count() or 1
    share = {f: d.get(f, 0) / total * ncpu for f in CPU_FIELDS}  # cores
    ipis = ", ".join(f"{INTERRUPTS[k]} {d[k] / seconds:,.0f}/s" for k in INTERRUPTS if k in d)
    lines = [f"census over {seconds:.1f} s, {images:,.0f} images: host {ncpu - share['idle'] - share['iowait']:.1f} "
             f"of {ncpu} cores busy (" + ", ".join(f"{f} {share[f]:.2f}" for f in CPU_FIELDS if f != "idle")
             + f"); {d.get('ctxt', 0) / seconds:,.0f} context switches/s, {d.get('intr', 0) / seconds:,.0f} "
             f"interrupts/s" + (f" ({ipis})" if ipis else "")]
    work = spent(before, after)
    per_image = max(images, 1)

    def row(label: str, group: list[Thread], count: str) -> str:
        cpu = sum(t.user + t.system for t in group)
        return (f"{label:<34} {count:>9} {_cores(cpu, seconds):>6.2f} {cpu / TICKS / per_image * 1e3:>7.3f} "
                f"{sum(t.system for t in group) / max(cpu, 1):>5.0%} {sum(t.faults for t in group) / per_image:>8.1f}"
                f" {sum(t.switches for t in group) / seconds:>9,.0f}"
                f" {sum(t.preempted for t in group) / seconds:>9,.0f}")

    lines.append(f"{'role / thread kind':<34} {'threads':>9} {'cores':>6} {'ms/img':>7} {'sys':>5} {'flt/img':>8} "
                 f"{'waits/s':>9} {'preempt/s':>9}")
    roles: dict[str, list[Thread]] = {}
    for t in work.values():
        roles.setdefault(t.role, []).append(t)
    for role, group in sorted(roles.items(), key=lambda r: -sum(t.user + t.system for t in r[1])):
        processes = len({pid for (pid, _), t in work.items() if t.role == role})
        lines.append(row(role, group, f"{processes}p {len(group)}t"))
        kinds: dict[str, list[Thread]] = {}
        for t in group:
            kinds.setdefault(t.kind, []).append(t)
        for kind, alike in sorted(kinds.items(), key=lambda k: -sum(t.user + t.system for t in k[1])):
            if sum(t.user + t.system for t in alike):
                lines.append(row(f"  {kind}", alike, str(len(alike))))
    lines.append(f"busiest threads of {len(work)}:")
    for (pid, tid), t in sorted(work.items(), key=lambda kv: -(kv[1].user + kv[1].system))[:top]:
        lines.append(row(f"  {t.role} {pid}/{tid} {t.name}", [t], "1"))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pids", nargs="+", type=int)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--images", type=float, default=0, help="done in the window, for the ms per image")
    args = p.parse_args()
    before = snapshot(args.pids)
    time.sleep(args.seconds)
    print("\n".join(report(before, snapshot(args.pids), args.images)))


if __name__ == "__main__":
    main()
