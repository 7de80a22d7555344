"""Helpers shared by the attention benchmarks: machine description, SDPA path, Markdown.

Not a benchmark itself. Every results file starts with ``machine_header`` so a number is never
separated from the machine, threads and load it was measured under.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str) -> dict[str, str]:
    """What the numbers depend on: CPU, cores, torch, threads, load, GPU, date."""
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores (os.cpu_count)": str(os.cpu_count()),
        "cores usable (sched_getaffinity)": str(len(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else "n/a",
        "torch": torch.__version__,
        "torch default threads": str(torch.get_num_threads()),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "device": device,
    }
    info["macformer_lit commit"] = git_state()
    if hasattr(os, "getloadavg"):
        info["load average at start (1/5/15 min)"] = "{:.2f} / {:.2f} / {:.2f}".format(
            *os.getloadavg()
        )
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
    return info


def git_state() -> str:
    """Commit the benchmark runs from, and whether the attention package differs from it;
    ``MACFORMER_LIT_COMMIT`` overrides both (a lent GPU machine receives the working tree with
    the .git of the session's start, so git there names a stale commit)."""
    given = os.environ.get("MACFORMER_LIT_COMMIT", "")
    if given:
        return f"{given} (given by MACFORMER_LIT_COMMIT)"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "macformer_lit/attention"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in macformer_lit/attention/" if dirty else "")


def sdpa_path(device: str, dtype: torch.dtype = torch.float32, head_dim: int = 64) -> dict:
    """Which SDPA kernel softmax takes, per direction and pass, read from the profiler's op
    names (``aten::_scaled_dot_product_flash_attention_for_cpu`` is the fused CPU kernel,
    ``..._attention_math`` the unfused math path)."""
    paths = {}
    for causal in (False, True):
        q, k, v = (
            torch.randn(1, 2, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        activities = [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.sum().backward()
        names = sorted(
            {
                e.name
                for e in prof.events()
                if "scaled_dot_product" in e.name
                or "flash_attention" in e.name
                or "efficient_attention" in e.name
                or "cudnn_attention" in e.name
            }
            - {"aten::scaled_dot_product_attention"}
        )
        paths["causal" if causal else "bidirectional"] = names
    return paths


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def md_header(title: str, info: dict[str, str], extra: dict[str, str] | None = None) -> str:
    """Title plus a bullet list of the machine facts (and any run facts in ``extra``)."""
    lines = [f"# {title}", ""]
    for key, value in {**info, **(extra or {})}.items():
        lines.append(f"- **{key}**: {value}")
    return "\n".join(lines) + "\n"


def csv_comment_header(info: dict[str, str], extra: dict[str, str] | None = None) -> str:
    """The same facts as ``# key: value`` lines, for the top of a CSV file."""
    return "".join(f"# {k}: {v}\n" for k, v in {**info, **(extra or {})}.items())


def fmt_sci(x: float, digits: int = 2) -> str:
    if x != x:
        return "nan"
    return f"{x:.{digits}e}"


def progress(msg: str) -> None:
    print(msg, flush=True)


def try_import(name: str) -> Callable | None:
    """The module ``name`` if it imports, else None."""
    try:
        return __import__(name)
    except Exception:
        return None


def cpu_allocation_peak(call: Callable[[], object]) -> tuple[int, list[dict]]:
    """Run ``call`` under ``torch.profiler(profile_memory=True)``: the peak of the running sum
    of the CPU allocator's allocations and frees during it (extra bytes over what was live
    before), and the trace's events for callers that also want the ops it ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted(
        (float(e["ts"]), e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0
    )
    current = peak = 0
    for _, nbytes in mem:
        current += nbytes
        peak = max(peak, current)
    return int(peak), events
