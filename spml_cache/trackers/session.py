"""The trackers of one run, each in a thread of its own (`Channel`), so that a slow or gone server never holds
the training up; and what they keep in the run directory (`Ledger`: trackers.json), so that `--resume` goes on in
the same tracker runs and logs each epoch once."""

from __future__ import annotations

import copy
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from spml_cache import runs
from spml_cache.runtime.errors import stop_requested
from spml_cache.trackers.base import TRACKERS_FILE, Tracker
from spml_cache.trackers.reading import epochs_of, read_outcome, read_run

SAVE_EVERY_S = 1.0  # trackers.json is written again at most this often while epochs come (and at every end)
START_WAIT_S = 60.0  # the training waits this long at most for the trackers to open their runs (MLflow's import: 4 s)
STOP_WAIT_S = 0.8  # what a stop leaves the trackers to close their runs in: the command ends within 2 s of a signal
SLOW_S = 3.0  # a tracker still sending the last values after this long is said to be waited for


class Ledger:
    """trackers.json: per tracker, what it needs to find its run again (ids, the tracking URI) and, per head, the
    last epoch it logged (`logged`). Each channel's thread puts its own record; the file is written whole."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / TRACKERS_FILE
        self.records = runs.read_json(self.path, dict) if self.path.exists() else {}
        self.lock = threading.Lock()
        self.saved_at = 0.0

    def record(self, name: str) -> dict:
        return {"logged": {}, **copy.deepcopy(self.records.get(name, {}))}

    def put(self, name: str, record: dict, soon: bool = False) -> None:
        """Keep `record` as tracker `name`'s; written now unless `soon` and it was written under a second ago."""
        with self.lock:
            self.records[name] = copy.deepcopy(record)
            if not (soon and time.monotonic() - self.saved_at < SAVE_EVERY_S):
                self._write()

    def save(self) -> None:
        """Write what every tracker put (from the stage's thread, as a stop ends: a tracker still sending puts no
        more)."""
        with self.lock:
            self._write()

    def _write(self) -> None:
        runs.write_json(self.path, self.records)
        self.saved_at = time.monotonic()


def one_line(err: BaseException, limit: int = 300) -> str:
    """An error as one short line: its first line (a server's error page or a traceback text is not for a run's
    output), cut at `limit` characters."""
    text = (str(err).strip().splitlines() or [""])[0] or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Channel:
    """One tracker's thread: it starts the tracker's run, then takes each message as it comes (metrics lines,
    coalesced; then `finish` or `stop`). The first error ends it with one line; the run goes on without it."""

    def __init__(self, tracker: Tracker, run, ledger: Ledger, say: Callable[[str], None]) -> None:
        self.tracker, self.run, self.ledger, self.say = tracker, run, ledger, say
        self.record = ledger.record(tracker.name)
        ledger.put(tracker.name, self.record)  # before its thread starts: a resume logs to it, however soon this stops
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.held: tuple | None = None  # a message taken while coalescing lines, handled next
        self.failed = False
        self.started = threading.Event()  # its run is open (or it failed to open it)
        self.ended = threading.Event()  # it has sent everything, or failed: nothing more to wait for
        tracker.took, tracker.stopping = self._took, threading.Event()
        self.thread = threading.Thread(target=self._work, name=f"spml-cache --log {tracker.name}", daemon=True)
        self.thread.start()

    def send(self, kind: str, payload=None) -> None:
        if not self.failed:
            self.messages.put((kind, payload))

    def stop(self, failed: bool) -> None:
        """Close the tracker's run now: lines still waiting are left to a resume (the ledger says what was taken)."""
        self.tracker.stopping.set()
        self.send("stop", failed)

    def _next(self) -> tuple:
        """The next message; consecutive metrics lines as one (a tracker slower than the epochs sends fewer,
        larger batches)."""
        kind, payload = self.held or self.messages.get()
        self.held = None
        while kind == "lines" and self.tracker.stopping.is_set():  # stopped: only the stop is left to take
            kind, payload = self.messages.get()
        while kind == "lines":
            try:
                following = self.messages.get_nowait()
            except queue.Empty:
                break
            if following[0] != "lines":
                self.held = following
                break
            payload = payload + following[1]
        return kind, payload

    def _work(self) -> None:
        name = self.tracker.name
        try:
            try:
                self.tracker.start(self.run, self.record)
                self.ledger.put(name, self.record)
            finally:
                self.started.set()
            while True:
                kind, payload = self._next()
                if kind == "lines":
                    self._log(payload)
                    continue
                if kind == "finish":
                    where = self.tracker.finish(payload)
                    self.record["finished"] = True
                    self.ledger.put(name, self.record)
                    self.ended.set()
                    self.say(where)
                else:
                    self.ledger.put(name, self.record)  # first: what was taken is known, however the close goes
                    self.tracker.stop(failed=payload)
                return
        except Exception as err:
            self.failed = True
            self.ended.set()
            said = self.tracker.explain(err) or one_line(err)
            self.say(f"--log {name}: {said}: the run goes on without {name}; its own files in {self.run.run_dir} are"
                     " whole")

    def _log(self, lines: list[dict]) -> None:
        """The epochs of `lines` this tracker has not logged yet (a resumed run writes its kept lines again, and
        trains again the parts it had not kept)."""
        logged = self.record["logged"]
        fresh = [epoch for epoch in epochs_of(lines, self.run.epochs) if epoch.epoch > logged.get(epoch.head.id, -1)]
        if fresh:
            self.tracker.epochs(fresh)

    def _took(self, epochs: list) -> None:
        """Epochs the tracker has stored: each head's last logged epoch (and the ids it made) into the ledger."""
        logged = self.record["logged"]
        for epoch in epochs:
            logged[epoch.head.id] = max(epoch.epoch, logged.get(epoch.head.id, -1))
        self.ledger.put(self.tracker.name, self.record, soon=True)


class Session:
    """The trackers of one run directory: what the stage's metrics lines and its end are sent to."""

    def __init__(self, trackers: list[Tracker], run_dir: Path, say: Callable[[str], None]) -> None:
        self.run_dir, self.say = run_dir, say
        run, self.ledger = read_run(run_dir), Ledger(run_dir)
        self.channels = [Channel(tracker, run, self.ledger, say) for tracker in trackers]

    def wait_started(self) -> None:
        """Until every tracker has opened its run (or failed to: its line comes before the training), at most
        `START_WAIT_S`; a signal ends the wait (the training then stops at its first safe point)."""
        began = time.monotonic()
        for channel in self.channels:
            while not channel.started.wait(0.1):
                if stop_requested() is not None or time.monotonic() - began > START_WAIT_S:
                    return

    def lines(self, lines: list[dict]) -> None:
        """Metrics lines as written (`runs.watch_metrics`): handed to each tracker's thread, nothing more here."""
        if lines:
            for channel in self.channels:
                channel.send("lines", lines)

    def finish(self) -> None:
        """The run's results (results.json) to every tracker, waited for: the command ends once they have them,
        or once a signal says not to wait (the run's files are whole either way)."""
        try:
            outcome = read_outcome(self.run_dir)
        except Exception as err:  # the run is done and written: never an error of the command now
            self.say(f"--log: the trackers got no results ({one_line(err)}); the run's own files in {self.run_dir}"
                     " are whole")
            self.stop(failed=False)
            return
        for channel in self.channels:
            channel.send("finish", outcome)
        if not self._wait(None):  # left at a signal: what each tracker had stored is kept
            for channel in self.channels:
                channel.tracker.stopping.set()
            self.ledger.save()

    def stop(self, failed: bool) -> None:
        """The run stopped (or failed): each tracker closes its run as such, within the little time a stop has;
        trackers.json then holds what each had stored (one still sending when the time is up included)."""
        for channel in self.channels:
            channel.stop(failed)
        self._wait(STOP_WAIT_S)
        self.ledger.save()

    def _wait(self, limit: float | None) -> bool:
        """Wait for every channel's thread to end: without `limit`, until they do or a signal comes (then a short
        while more); False when it left before they ended."""
        began, told = time.monotonic(), False
        for channel in self.channels:
            while channel.thread.is_alive():
                channel.thread.join(0.1)
                waited = time.monotonic() - began
                if limit is not None and waited > limit:
                    return False
                if limit is None and stop_requested() is not None and not channel.ended.is_set():
                    self.say(f"--log {channel.tracker.name}: left before it took all of the run's values; the run's"
                             f" own files in {self.run_dir} are whole")
                    limit = waited + STOP_WAIT_S
                if not told and limit is None and waited > SLOW_S and not channel.ended.is_set():
                    self.say(f"--log {channel.tracker.name}: sending the run's last values (Ctrl-C leaves them)")
                    told = True
        return True
