"""Weights & Biases that never prompts: online with credentials, offline without.

With no API key (``WANDB_API_KEY``, or a password in the netrc entry for the W&B host:
``WANDB_BASE_URL``'s, default api.wandb.ai, in the file wandb reads, ``$NETRC`` or
``~/.netrc``) the run is written offline under ``<save_dir>/wandb/offline-run-*`` and the
log says how to ``wandb sync`` it. ``WANDB_MODE`` in the environment wins over the guess.

Online asked for explicitly (``--wandb_mode online`` or ``WANDB_MODE=online``) without a key
is refused at parse time in one line (``check_wandb_mode``). With a key but no way to the
server (no network, a firewall, a wrong ``WANDB_BASE_URL``) the run logs offline, saying so,
after a probe bounded by ``WANDB_PROBE_TIMEOUT`` seconds (default 5): wandb itself waits
~90 s and then raises.
"""

from __future__ import annotations

import csv
import logging
import netrc
import os
import sys
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from macformer_lit.metrics_file import append_whole, csv_text, replace_whole

log = logging.getLogger(__name__)

Mode = Literal["auto", "online", "offline", "disabled"]


def netrc_path() -> Path:
    """The netrc file wandb reads its key from (``wandb.sdk.lib.wbauth.wbnetrc``): ``$NETRC``
    when set and not empty (``~`` expanded), else ``~/.netrc``, else ``~/_netrc`` if only
    that one exists."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    home = Path.home()
    if not (home / ".netrc").exists() and (home / "_netrc").exists():
        return home / "_netrc"
    return home / ".netrc"


def has_wandb_credentials() -> bool:
    """Whether wandb will find an API key: ``WANDB_API_KEY``, or a netrc entry with a
    password for the W&B host. An entry without a password holds no key (wandb would ask
    for one), and an unreadable file none either."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    try:
        path = netrc_path()
        entry = netrc.netrc(path).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        return False
    return entry is not None and bool(entry[2])


def check_wandb_mode(mode: Mode | None) -> None:
    """Online W&B needs an API key: without one, wandb raises a 45-line traceback once the
    run has started; here it is one line, before anything is built."""
    from macformer_lit.preflight import UsageError

    resolved = resolve_mode(mode or "auto")
    if resolved != "online" or has_wandb_credentials():
        return
    asked = "--wandb_mode online" if mode == "online" else f"WANDB_MODE={os.environ['WANDB_MODE']}"
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    raise UsageError(
        f"{asked}: no W&B API key found (WANDB_API_KEY, or a password for {host} in "
        f"{netrc_path()}): run 'wandb login' or set WANDB_API_KEY; or log offline with "
        "--wandb_mode offline, or not at all with --wandb_mode disabled"
    )


def probe_timeout() -> float:
    try:
        return max(0.1, float(os.environ.get("WANDB_PROBE_TIMEOUT", "5")))
    except ValueError:
        return 5.0


def unreachable(url: str, timeout: float) -> str | None:
    """Why ``url`` cannot be reached within ``timeout`` seconds, or None when it answers
    (any HTTP status counts: the server is there). Run in a thread so that a name lookup,
    which socket timeouts do not bound, cannot stall the run either."""
    import threading
    import urllib.error
    import urllib.request

    result: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(url, timeout=timeout).close()
            result.append(None)
        except urllib.error.HTTPError:
            result.append(None)
        except Exception as err:  # URLError, timeout, refused, bad URL: no server
            reason = getattr(err, "reason", None) or err
            result.append(str(reason) or type(err).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return result[0] if result else f"no answer within {timeout:g} s"


def resolve_mode(mode: Mode) -> str:
    env = os.environ.get("WANDB_MODE")
    if mode == "auto":
        if env in ("online", "offline", "disabled", "run", "dryrun"):
            return {"run": "online", "dryrun": "offline"}.get(env, env)
        return "online" if has_wandb_credentials() else "offline"
    return mode


class AutoWandbLogger(WandbLogger):
    """``WandbLogger`` whose ``mode: auto`` picks online or offline by credentials."""

    def __init__(
        self,
        *,
        save_dir: str = ".",
        project: str = "macformer_lit",
        name: str | None = None,
        mode: Mode = "auto",
        entity: str | None = None,
        tags: list[str] | None = None,
        group: str | None = None,
        log_model: bool = False,
    ) -> None:
        resolved = resolve_mode(mode)
        if resolved == "offline" and mode == "auto":
            log.info("W&B: no credentials found, logging offline under %s/wandb", save_dir)
        self._save_dir_for_notes = save_dir
        # Only rank 0 logs (and creates the run folder): under torchrun or SLURM the other
        # ranks start with their own guess of the folder, which must stay uncreated.
        if rank_zero_only.rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(
            save_dir=save_dir,
            project=project,
            name=name,
            offline=resolved == "offline",
            mode=resolved,
            entity=entity,
            tags=tags,
            group=group,
            log_model=log_model,
        )
        # Lightning always passes anonymous=None, which wandb >= 0.19 warns about.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self.mode = resolved

    def _go_offline(self, why: str) -> str:
        log.warning(
            "W&B: %s: logging offline under %s/wandb instead; upload it later with "
            "'wandb sync <that folder>'",
            why,
            self._save_dir_for_notes,
        )
        self._wandb_init["mode"] = "offline"
        self._offline = True
        self.mode = "offline"
        return "offline"

    @property
    @rank_zero_experiment
    def experiment(self):
        """The wandb run; a server that answers the probe but refuses the run (a wrong URL,
        an outage) gets the run offline, saying so, and a key it rejects one line."""
        if self._experiment is None and self.mode == "online":
            # Before wandb.init, which waits ~90 s for a server that does not answer.
            base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            why = unreachable(base, probe_timeout())
            if why is not None:
                self._go_offline(f"cannot reach {base} ({why})")
        try:
            return WandbLogger.experiment.fget(self)
        except Exception as err:
            import wandb

            if self.mode != "online" or not isinstance(err, wandb.errors.Error):
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if isinstance(err, (wandb.errors.AuthenticationError, wandb.errors.UsageError)):
                from macformer_lit.preflight import UsageError

                raise UsageError(
                    f"W&B refused the API key ({first}): check WANDB_API_KEY or run 'wandb "
                    "login --relogin'; or log offline with --wandb_mode offline"
                ) from None
            with _quiet():
                wandb.finish(exit_code=1)  # a half-started run would be reused
            self._experiment = None
            self._go_offline(f"the server did not start the run ({first[:200]})")
            return WandbLogger.experiment.fget(self)

    def run_dir(self) -> str | None:
        """The local folder of this run (``wandb sync`` takes it), once the run exists."""
        if self._experiment is None:
            return None
        return str(Path(self._experiment.dir).parent)


def _quiet():
    import contextlib
    import io

    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def finish_wandb_quietly(exit_code: int = 1, *, preempted: bool = False) -> None:
    """Close this process's W&B run without its closing lines ("You can sync this run ...",
    the run summary): printed at exit, after the error that ended the run, they would
    bury it. The run's folder is kept; ``wandb sync`` still takes it. ``preempted``: a
    stop on purpose that saved ``last.ckpt`` (SIGTERM, Ctrl-C): the run is marked
    preempting, which W&B shows as preempted, not failed."""
    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return
    try:
        with _quiet():
            if preempted:
                wandb.run.mark_preempting()
            wandb.finish(exit_code=exit_code)
    except Exception:  # closing is best effort: the error being reported matters more
        pass


class MetricsWriteError(OSError):
    def __str__(self) -> str:
        return self.strerror  # the whole sentence, without "[Errno 28]"


class _AppendingWriter(ExperimentWriter):
    """Appends to an existing ``metrics.csv`` (a resumed run) instead of deleting it, and
    writes rows whole: appended in one write, or the file replaced at once when a new
    column changes the header (Lightning rewrites it in place, where a kill loses it)."""

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text and not text.endswith("\n"):
            # A row cut by a kill (before rows were written whole): appending after it
            # would glue the next row onto it.
            cut = text.rfind("\n") + 1
            log.warning(
                "%s, line %d: dropped a row the file ended inside (its writer was stopped mid-row)",
                path,
                text.count("\n", 0, cut) + 1,
            )
            replace_whole(path, text[:cut])
        with open(path, newline="", encoding="utf-8") as file:
            self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    failed = False

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        self._record_new_keys()
        try:
            # Append only under the header the file has: after a failed save the keys may
            # have grown without the file (the rows then go out with a new header).
            if path.is_file() and _header(path) == self.metrics_keys:
                append_whole(path, csv_text(self.metrics, self.metrics_keys))
            else:
                old = []
                if path.is_file():
                    with open(path, newline="", encoding="utf-8") as f:
                        old = list(csv.DictReader(f))
                header = csv_text([self.metrics_keys])
                replace_whole(path, header + csv_text(old + self.metrics, self.metrics_keys))
        except OSError as err:
            # A full disk: one line naming the file. The rows stay, to be written whole by the
            # next save once there is room; a save that fails again after that (the logger's
            # finalize while this error unwinds) is silent, so this line stays the last.
            if self.failed:
                return
            self.failed = True
            raise MetricsWriteError(
                err.errno,
                f"could not write {path} ({err.strerror or err}): the rows written before are "
                "intact; free disk space or point --runs_dir at another disk, then resume with "
                "--ckpt_path last",
            ) from None
        self.metrics = []
        self.failed = False


def _header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), [])


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<save_dir>/metrics.csv`` that keeps earlier rows on resume."""

    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir=save_dir, name="", version="")

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    # ---- kept in step with checkpoints (callbacks.preemption.MetricsRowsCheckpoint) ----
    @property
    def metrics_path(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    def rows_on_disk(self) -> int:
        """Write pending rows, then count the data rows of metrics.csv (rank 0 only)."""
        self.save()
        if not self.metrics_path.is_file():
            return 0
        with open(self.metrics_path, newline="") as f:
            return max(sum(1 for _ in csv.reader(f)) - 1, 0)

    def drop_rows_after(self, rows: int, step: int) -> int:
        """Drop the data rows past the first ``rows`` that were logged at ``step`` or later
        (atomically); return how many were dropped. Rows past ``rows`` with an earlier step
        stay: a checkpoint saved in ``on_train_batch_end`` precedes its own batch's row."""
        if not self.metrics_path.is_file():
            return 0
        with open(self.metrics_path, newline="") as f:
            header, *table = list(csv.reader(f))
        if "step" not in header:
            return 0
        col = header.index("step")

        def later(row: list[str]) -> bool:
            try:
                return int(float(row[col])) >= step
            except (ValueError, IndexError):
                return False

        kept = table[:rows] + [r for r in table[rows:] if not later(r)]
        dropped = len(table) - len(kept)
        if dropped:
            tmp = self.metrics_path.with_name(f".metrics.csv.tmp-{os.getpid()}")
            with open(tmp, "w", newline="") as f:
                csv.writer(f).writerows([header, *kept])
            os.replace(tmp, self.metrics_path)
        return dropped
