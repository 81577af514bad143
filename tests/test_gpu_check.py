"""The GPU check's driver (bench/gpu_check.py) rehearsed on the CPU: its parts in order, each cut at its time box
with every process it started and the next one run, every line and the summary written as they come, and a CUDA
host serving on the CPU told at the summary's top (forced here with --expect-cuda)."""
import os
import subprocess
import sys
import time
from pathlib import Path

from service_process import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from gpu_check import ALARM, BOXES, Part, cpu_served, run_parts  # noqa: E402

from service.engine.runtime import CPU, CUDA  # noqa: E402


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_part_past_its_box_is_cut_with_its_children_the_next_runs_and_the_summary_is_told_at_once(tmp_path):
    summary, report = tmp_path / "summary.txt", []
    python = sys.executable
    sleeper = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(600)']); print('child', child.pid, flush=True); time.sleep(600)")
    parts = [Part("sleeps", [python, "-c", sleeper], 2),  # past its box, whatever the host's speed
             Part("reads", [python, "-c", f"print(open({str(summary)!r}).read())"], 60),
             Part("alarms", [python, "-c", f"print('{ALARM}served on the CPU'); raise SystemExit(3)"], 60)]
    alarms: list[str] = []
    outcomes = run_parts(report.append, summary, "the check", parts, alarms)
    assert [(o.name, o.status) for o in outcomes] == [("sleeps", "CUT"), ("reads", "ok"), ("alarms", "FAILED")]
    child = int(next(line for line in report if line.startswith("child ")).split()[1])
    deadline = time.monotonic() + 60  # a liveness bound: SIGKILL is delivered, not waited for
    while not gone(child):
        assert time.monotonic() < deadline, "the cut part's own child outlived it"
        time.sleep(0.05)
    # what the second part read: the summary as the first part's end left it
    told = report[next(i for i, line in enumerate(report) if "== reads" in line) + 2:]
    assert told[0] == "the check" and told[1].startswith("sleeps    CUT") and "of its 2 s box" in told[1]
    assert told[2] == "reads     not run (yet)" and told[3] == "alarms    not run (yet)"
    final = summary.read_text().splitlines()
    assert final[:2] == ["the check", f"{ALARM}alarms: served on the CPU"]
    assert [line.split()[:2] for line in final[2:]] == [["sleeps", "CUT"], ["reads", "ok"], ["alarms", "FAILED"]]


def test_the_rehearsal_runs_every_part_in_order_within_its_box_and_tells_the_cpu_fallback_first(tmp_path):
    """The whole driver on a budget of 21 s: each part is cut, fails or passes (which, depends on this host's
    speed), in BOXES' order, and the forced CUDA host that serves on the CPU is an alarm at the top."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--quick", "--budget", "21", "--expect-cuda",
                           "--out", str(out), "--cache", str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "GPU_CHECK_COMMIT": "rehearsal"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (summary,) = out.glob("gpu-*-rehearsal-summary.txt")
    lines = summary.read_text().splitlines()
    assert lines[1].startswith(f"{ALARM}check: a CUDA host (--expect-cuda) whose CUDA provider does not start")
    outcomes = [line.split() for line in lines if line.split()[0] in BOXES]
    assert [o[0] for o in outcomes] == list(BOXES) and all(o[1] in ("ok", "CUT", "FAILED") for o in outcomes)
    report = (out / summary.name.replace("-summary", "")).read_text()
    heads = [report.index(f"\n== {name} (box ") for name in BOXES]
    assert heads == sorted(heads) and report.rstrip().endswith(lines[-1])


def test_a_model_served_on_the_cpu_is_a_fallback_unless_it_is_the_int8_export():
    models = [{"name": "deit", "precision": "fp16", "provider": CUDA},
              {"name": "swin", "precision": "fp32", "provider": CPU},
              {"name": "vit-int8", "precision": "int8", "provider": CPU},
              {"name": "broken", "precision": "fp32", "provider": None}]
    assert cpu_served(models) == ["swin (fp32 on CPUExecutionProvider)", "broken (fp32 on None)"]


def test_the_staging_carries_one_part_a_call_from_the_emptied_checkout_and_the_last_runs_the_check_in_its_tree():
    """The tree is over a call's 64 MiB (the embedded graphs), so it travels in the parts: every call is made from
    the emptied checkout with one part, within the tool's 2,000 characters, and the last unpacks all of them
    before it runs the staged tree's setup and check."""
    from gpu_stage import MAX_CALLS, REMOTE, calls, update_calls
    parts = [f".gpu/part{i:02d}" for i in range(MAX_CALLS)]
    steps = calls(parts, "main", "abc1234")
    assert steps[0].startswith("here:  git switch --orphan ") and steps[-1] == "here:  git switch main"
    device = steps[1:-1]
    assert [step.split()[:4] for step in device] == [["call", f"{i + 1}:", "carry", f'["{part}"]']
                                                     for i, part in enumerate(parts)]
    assert all(len(step.split("command: ", 1)[1].rsplit("  (timeout_s", 1)[0]) <= 2000 for step in device)
    unpack, check = device[-1].index(f"tar -xf - -C {REMOTE}"), device[-1].index(f"cd {REMOTE}/tree && source "
                                                                                   "bench/gpu_setup.sh")
    assert unpack < check and "GPU_CHECK_COMMIT=abc1234 python3 bench/gpu_check.py --out $OUT" in device[-1]
    assert "cat /root/stage/part*" in device[-1] and all("/root/stage" in step for step in device)
    rerun = update_calls(".gpu/update.tar.xz", "main", "def5678")
    assert rerun[0].startswith("here:  git switch --orphan ") and rerun[-1] == "here:  git switch main"
    assert f"-C {REMOTE}/tree && cd {REMOTE}/tree && source bench/gpu_setup.sh" in rerun[1]
    assert (ROOT / "bench" / "gpu_setup.sh").read_text().count("/root/stage") == 0  # the last call unpacked them


def test_the_op_profile_counts_each_profiled_run_once_and_its_op_types_add_up_to_its_nodes():
    """bench/op_profile.py (the check's ops part) on the embedded Swin: the warm-up runs left out, every node once
    a run, the op types' times the nodes' sum, the export's fused attention among them."""
    from op_profile import by_node, by_op_type, profile, profiled_runs
    events = profile(ROOT / "model_repository" / "shapes-swin", batch=2, runs=3, cuda=False)
    nodes, walls = profiled_runs(events, 3)
    per_run = len({e["name"] for e in nodes})
    assert len(walls) == 3 and len(nodes) == 3 * per_run > 100
    assert len(profiled_runs(events, 5)[0]) == 5 * per_run  # the 2 warm-up runs are there too, and left out above
    types, each = by_op_type(nodes, 3), by_node(nodes, 3)
    assert sum(count for _, count, _ in types) == len(each) == per_run
    assert abs(sum(ms for *_, ms in types) - sum(ms for *_, ms in each)) < 1e-6
    assert ("Attention", "CPU") in {op for op, *_ in types}
