"""The script render service: jobs that turn a script's lines into takes of a directing session.

- ``create`` stores the script (every line gets its seed now, so a resumed render makes the same lines) and starts
  its job; a job renders every line that needs it, as many at once as :class:`~moss_rt.scripts.fairness.FairShare`
  grants its client, at ``TakePriority.BATCH``, so the whole batch advances together while interactive takes come
  first.
- A failed line is tried once more, then marked failed with the reason; the others go on. A busy or loading engine
  is waited for. A deleted session ends the job (``error`` event).
- ``retake`` renders one line again (new words, direction, seed, or from a frame of its take) at interactive
  priority; ``accept`` makes any take of the session the line's (a retake directed in the studio). Either replaces
  the line in the next export; nothing else is rendered again.
- Word timing: a line's render ends once its take's words are aligned and kept (when the server has an aligner),
  so an export has its captions by word at once (:mod:`moss_rt.scripts.words`).
- Restarts: a render's take id, request and seed are written before the engine is asked, so ``start`` resumes
  every unfinished script where it stopped and finished lines are never rendered again.
- Several front ends on one store: a script renders on the front end holding its lease (moss_rt/scripts/store.py);
  this service renews the leases it holds, resumes scripts whose lease ran out (their front end stopped), and
  takes a script over when a director retakes or accepts one of its lines here; a front end that lost a lease
  stops that script's renders and ends its event streams (their clients reconnect). Elsewhere a script is read
  from the database on every request, so every front end shows its current state.

Every task (job runners, line renders, the resume) is owned here and cancelled by :meth:`ScriptService.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from typing import Any

from moss_rt.align.base import WordTime
from moss_rt.engine.base import TakePriority
from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.scripts.events import EventLog
from moss_rt.scripts.fairness import FairShare
from moss_rt.scripts.format import Script
from moss_rt.scripts.job import Job, LineState
from moss_rt.scripts.render import LineFailed, LineInterrupted, LineNoRoom, SessionGone, render_line
from moss_rt.scripts.store import (
    DONE,
    FAILED,
    PENDING,
    LeaseLost,
    LineRow,
    ScriptRow,
    ScriptStore,
    new_script_id,
    not_found,
    short_script_id,
)
from moss_rt.scripts.timeline import Timeline
from moss_rt.scripts.words import LineWords
from moss_rt.session import new_take_id, random_seed
from moss_rt.session_records import StorageFull, StoredTake, short_id
from moss_rt.session_store import SessionStore
from moss_rt.storage.database import StoreUnavailable
from moss_rt.web.state import ServiceState

log = logging.getLogger(__name__)

ATTEMPTS = 2  # a failed line is tried once more, then marked failed
IDLE_JOBS_KEPT = 256  # finished scripts kept in memory (the rest are read from the database when asked for)
CLOSE_TIMEOUT_SEC = 10.0
DEFAULT_ENGINE_SLOTS = 64  # what the memory plan gives a CPU, when the engine does not say
LEASE_SEC = 60.0  # a script's lease; another front end resumes it this long after its renewals stop
RENEW_SEC = 15.0  # how often leases are renewed, and scripts whose lease ran out looked for


class _Place:
    """A line's place in the fair share: given back as soon as the engine is done with its take (storing it
    needs no engine place), taken again for a second attempt."""

    def __init__(self, share: FairShare, client: str) -> None:
        self._share = share
        self._client = client
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._share.release(self._client)

    def on_done(self, _task: asyncio.Task[Any]) -> None:
        self.release()

    async def again(self) -> None:
        if not self._held:
            await self._share.acquire(self._client)
            self._held = True


class ScriptService:
    def __init__(self, state: ServiceState, sessions: SessionStore, store: ScriptStore) -> None:
        self.state = state
        self.sessions = sessions
        self.store = store
        settings = state.settings
        slots = settings.max_slots or DEFAULT_ENGINE_SLOTS
        self.share = FairShare(*self._share_of(slots))
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.exports_running = 0  # zip exports streaming now (bounded by settings.max_script_exports)
        self.runner = sessions.front_end  # this front end's name on the scripts' leases
        self._held: set[str] = set()  # scripts whose lease this front end holds (its job here is their truth)
        self._adopting = asyncio.Lock()
        self.words = LineWords(state, sessions, self._spawn)  # the lines' word timing (moss_rt/scripts/words.py)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Resume unfinished scripts once the engine is ready, and keep the leases (in the background)."""
        self._spawn(self._resume(), "scripts-resume")
        self._spawn(self._keep_leases(), "scripts-leases")

    async def close(self) -> None:
        """Stop every render (their state stays on disk: the next start resumes them) and end every stream."""
        self._closing = True
        tasks = [t for t in self._tasks if not t.done()]
        for job in self._jobs.values():
            tasks += [t for t in job.tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SEC)
            if late:
                log.warning("%d script task(s) did not stop within %.0f s", len(late), CLOSE_TIMEOUT_SEC)
        for job in self._jobs.values():
            job.log.close()
        held, self._held = list(self._held), set()
        if held:  # another front end may resume them at once (a render cut short here stays queued)
            await asyncio.to_thread(self._release_all, held)

    def _release_all(self, script_ids: list[str]) -> None:
        """Give the leases up (bounded: the database away fails the first call within its wait, the rest at
        once; their leases then run out by themselves)."""
        for script_id in script_ids:
            with contextlib.suppress(ProtocolError):
                self.store.release(script_id, self.runner)

    def end_streams(self) -> None:
        """The service is shutting down: event streams end now (their renders stop at close)."""
        for job in self._jobs.values():
            job.log.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("script task %s failed", task.get_name(), exc_info=task.exception())

    def _share_of(self, slots: int) -> tuple[int, int]:
        settings = self.state.settings
        total = max(1, math.floor(slots * settings.script_total_share))
        return total, max(1, math.floor(slots * settings.script_client_share))

    async def _engine_ready(self) -> None:
        while not self.state.engine.info.ready:
            if self._closing:
                raise asyncio.CancelledError
            await asyncio.sleep(0.1)

    async def _resume(self) -> None:
        await self._engine_ready()
        details = self.state.engine.info.details
        slots = details.get("max_slots", "")
        if slots.isdigit() and int(slots) > 0:
            self.share.resize(*self._share_of(int(slots)))
        await self._adopt_unfinished()

    async def _adopt_unfinished(self) -> None:
        """Run every unfinished script this front end may run: its own, unleased, or whose lease ran out (one
        pass at a time: the start's and the lease keeper's never run the same script twice)."""
        async with self._adopting:
            for script_id in await asyncio.to_thread(self.store.unfinished, self.runner):
                running = self._jobs.get(script_id)
                if running is not None and self._running_here(running):
                    continue
                try:
                    if not await asyncio.to_thread(self.store.claim, script_id, self.runner, LEASE_SEC):
                        continue  # another front end was quicker
                    job = await self._load(script_id, fresh=True)
                except ProtocolError:
                    continue
                self._held.add(script_id)
                log.info(
                    "resuming script %s (%d lines to render)",
                    short_script_id(script_id),
                    sum(line.needs_render for line in job.lines.values()),
                )
                self._run(job)

    async def _keep_leases(self) -> None:
        """Renew the leases held here, stop the scripts another front end took over, and pick up scripts whose
        front end stopped renewing theirs."""
        while not self._closing:
            await asyncio.sleep(RENEW_SEC)
            try:
                held = sorted(self._held)
                lost = await asyncio.to_thread(self.store.renew, held, self.runner, LEASE_SEC) if held else []
                for script_id in lost:
                    if script_id in self._held:
                        await self._moved(script_id)
                if self.state.engine.info.ready and not self._closing:
                    await self._adopt_unfinished()
            except StoreUnavailable as exc:  # the database away for a while: try again at the next round
                log.warning("script leases: %s", exc.message)
            except Exception:
                log.exception("script leases: renewal failed")

    async def _moved(self, script_id: str) -> None:
        """Another front end took the script over (or it was deleted there): stop rendering it here and end its
        event streams, so that their clients reconnect to the state as the database has it."""
        self._held.discard(script_id)
        job = self._jobs.pop(script_id, None)
        if job is None:
            return
        log.info("script %s: rendered by another front end now; stopping here", script_id)
        current = asyncio.current_task()
        tasks = [t for t in (job.runner, *job.tasks.values()) if t is not None and not t.done() and t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SEC)
        job.log.close()

    @staticmethod
    def _running_here(job: Job) -> bool:
        return job.runner is not None or bool(job.tasks)

    def _release_when_idle(self, job: Job) -> None:
        """The script has nothing left to render here: give its lease up (while closing, :meth:`close` does)."""
        if not self._closing and job.script_id in self._held and not self._running_here(job) and not job.pending_work:
            self._held.discard(job.script_id)
            self._spawn(asyncio.to_thread(self._release_all, [job.script_id]), f"release-{job.script_id}")

    # ------------------------------------------------------------------ jobs
    async def create(self, script: Script, session_id: str | None, *, client: str, owner: str) -> Job:
        """Store ``script`` and start its render into ``session_id`` (which ``owner`` must be able to reach, else
        not_found as for an unknown session), or into a new session owned by ``owner``. ``client`` (the address
        that posted it) is whose fair share and caps the render counts against, and a new session's budget."""
        if self._closing or self.state.shutting_down:
            raise ProtocolError(ErrorCode.BUSY, "the service is shutting down")
        limit = self.state.settings.max_scripts_per_client
        active = sum(1 for job in self._jobs.values() if job.client == client and job.pending_work)
        if limit > 0 and active >= limit:
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"this client already has {active} scripts waiting or rendering (limit {limit}); wait for one to"
                " finish or delete one",
            )
        cues = script.cues
        created = session_id is None
        if session_id is None:
            if len(cues) > self.sessions.max_session_takes:
                raise self._no_room_for(len(cues), self.sessions.max_session_takes)
            if await asyncio.to_thread(self.sessions.room, client) <= 0:
                raise StorageFull("the sessions' budget for this client is spent")
            # The session caps (max_sessions: 507, max_sessions_per_client: 429) apply as to any new session.
            session_id = await asyncio.to_thread(self.sessions.create, owner=owner, client=client)
        else:
            await asyncio.to_thread(self.sessions.check_access, session_id, owner)
        try:
            # not_found if deleted meanwhile
            stored = {take.take_id for take in await asyncio.to_thread(self.sessions.takes, session_id)}
            room = self.sessions.max_session_takes - len(stored) - self._takes_to_come(session_id, stored)
            if len(cues) > room:
                raise self._no_room_for(len(cues), room)
            await asyncio.to_thread(self.sessions.check_room, session_id)  # 507 once the storage budget is spent
            seeds = [cue.seed if cue.seed is not None else random_seed() for cue in cues]
            script_id = new_script_id()
            await asyncio.to_thread(
                self.store.create, script_id, session_id, client, script.title, script.to_dict(), seeds,
                runner=self.runner, lease_sec=LEASE_SEC,
            )  # fmt: skip
        except BaseException:
            if created:  # nobody was told about it: it must not count against the client's caps
                with contextlib.suppress(ProtocolError):
                    await asyncio.to_thread(self.sessions.delete_session, session_id)
            raise
        self._held.add(script_id)
        job = await self._load(script_id)
        self._run(job)
        log.info(
            "script %s: %d lines for session %s, from %s",
            short_script_id(script_id),
            len(cues),
            short_id(session_id),
            client,
        )
        return job

    def _takes_to_come(self, session_id: str, stored: set[str]) -> int:
        """Takes the session's scripts will still add: their lines not rendered yet (each becomes a take). A line
        whose take is among the session's ``stored`` ones already (stored, not yet recorded done) is not one."""
        return sum(
            1
            for job in self._jobs.values()
            if job.session_id == session_id and job.failure is None
            for line in job.lines.values()
            if line.row.take_id is None
            and line.needs_render
            and (line.row.render is None or line.row.render["take"] not in stored)
        )

    def _no_room_for(self, lines: int, room: int) -> ProtocolError:
        return ProtocolError(
            ErrorCode.TOO_LARGE,
            f"the script has {lines} lines but the session has room for {max(0, room)} more takes"
            f" (a session keeps {self.sessions.max_session_takes}: max_session_takes); use a new session or split the"
            " script",
            field="session",
        )

    async def job_for(self, script_id: str, owner: str | None, *, share: str | None = None) -> Job:
        """The script's job, for a caller who may reach its session (its owner; with ``share``, the holder of the
        session's share token); anyone else gets not_found, exactly as for a script that does not exist."""
        job = await self.job(script_id)
        try:
            await asyncio.to_thread(self.sessions.check_access, job.session_id, owner, share=share)
        except ProtocolError as err:
            if err.code is ErrorCode.NOT_FOUND:
                raise not_found() from None
            raise
        return job

    async def job(self, script_id: str) -> Job:
        """The script's job: as this front end has it while it holds the script's lease (it is the only writer
        then), else as the database has it now (another front end may be rendering it); not_found if unknown."""
        job = self._jobs.get(script_id)
        if job is not None and self._authoritative(job):
            self._jobs.move_to_end(script_id)
            return job
        return await self._load(script_id)

    def _authoritative(self, job: Job) -> bool:
        return job.script_id in self._held or self._running_here(job)

    async def _load(self, script_id: str, *, fresh: bool = False) -> Job:
        """The script's job with its rows read now (``fresh``: even while this front end holds the lease, as when
        it has just claimed it). One object per script: an existing job is refreshed in place, so renders and
        listeners that hold it keep seeing the same one."""
        row: ScriptRow = await asyncio.to_thread(self.store.get, script_id)
        job = self._jobs.get(script_id)  # loaded, or started, meanwhile
        if job is not None and (self._running_here(job) or (not fresh and script_id in self._held)):
            return job
        if job is None:
            job = Job.of_row(row)
        else:
            job.refresh(row)
        job.elsewhere = row.runner is not None and row.runner != self.runner and (row.lease_until or 0.0) > time.time()
        self._remember(job)
        return job

    async def of_session(self, session_id: str) -> list[dict[str, Any]]:
        """The scripts rendered into a session (the caller's access to it is checked by the web layer)."""
        await asyncio.to_thread(self.sessions.require, session_id)
        rows = await asyncio.to_thread(self.store.of_session, session_id)
        out = []
        for row in rows:
            job = self._jobs.get(row.script_id)
            if job is None or not self._authoritative(job):
                job = Job.of_row(row)
            out.append({**job.progress(), "title": job.script.title, "created": job.created})
        return out

    async def delete(self, script_id: str) -> None:
        job = await self.job(script_id)
        self._jobs.pop(script_id, None)  # nothing of it is announced any more
        await self._stop(job)
        await asyncio.to_thread(self.store.delete, script_id)
        job.log.emit("error", {"code": ErrorCode.NOT_FOUND.value, "message": "the script was deleted"})
        job.log.close()
        log.info("script %s deleted", short_script_id(script_id))

    def _remember(self, job: Job) -> None:
        self._jobs[job.script_id] = job
        self._jobs.move_to_end(job.script_id)
        idle = [sid for sid, j in self._jobs.items() if not j.busy]
        for sid in idle[: max(0, len(idle) - IDLE_JOBS_KEPT)]:
            del self._jobs[sid]

    async def _stop(self, job: Job) -> None:
        tasks = [t for t in (job.runner, *job.tasks.values()) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SEC)

    # ------------------------------------------------------------------ the batch render
    def _run(self, job: Job) -> None:
        if job.runner is None and job.failure is None and job.pending_work and not self._closing:
            job.runner = self._spawn(self._render_all(job), f"script-{job.script_id}")

    async def _render_all(self, job: Job) -> None:
        job.no_room = None  # a new batch looks at the storage afresh
        try:
            await self._engine_ready()
            job.emit_progress()
            async with asyncio.TaskGroup() as group:
                for number in sorted(job.lines):
                    if not self._wanted(job, number):
                        continue
                    await self.share.acquire(job.client)
                    if not self._wanted(job, number):  # a retake took it while this waited
                        self.share.release(job.client)
                        continue
                    place = _Place(self.share, job.client)
                    task = group.create_task(self._batch_line(job, number, place), name=f"line-{number}")
                    # Released however the task ends: one cancelled before it ever ran (its group failing on
                    # another line) never reaches its own ``finally``.
                    task.add_done_callback(place.on_done)
                    job.tasks[number] = task
        except* SessionGone as gone:
            await self._session_gone(job, str(gone.exceptions[0]))
        except* LeaseLost:
            job.runner = None
            await self._moved(job.script_id)
        except* StoreUnavailable:
            log.warning("script %s: the session store is unavailable; its render resumes once it is back", job.log_id)
        finally:
            job.runner = None
            self._after_line(job)

    @staticmethod
    def _wanted(job: Job, number: int) -> bool:
        return number not in job.tasks and job.lines[number].needs_render and job.failure is None

    async def _batch_line(self, job: Job, number: int, place: _Place) -> None:
        try:
            await self._render(job, number, TakePriority.BATCH, place)
        except (SessionGone, LeaseLost, StoreUnavailable, asyncio.CancelledError):
            raise
        except Exception:  # a bug must cost one line, not the whole batch
            log.exception("script %s line %d: render failed", job.log_id, number)
            await self._line_failed(job, number, "internal error")
        finally:
            place.release()
            if job.tasks.get(number) is asyncio.current_task():
                del job.tasks[number]
            self._after_line(job)

    async def _render(self, job: Job, number: int, priority: TakePriority, place: _Place | None = None) -> None:
        """Render the line's queued render (or its first one), trying once more after a failure; a batch line
        holds its ``place`` while the engine makes its take.

        A take the session could not keep (its storage budget or the disk spent, the session full) fails its line
        at once, and the batch's later lines fail with the same reason without asking the engine: their takes
        would be refused too. A retake (someone waiting on it) is still tried."""
        line = job.lines[number]
        render = line.row.render or {
            "take": new_take_id(),
            "seed": line.row.seed,
            "text": job.text_of(number),
            "instruction": job.instruction_of(number),
            "parent": None,
            "frame": 0,
        }
        for attempt in range(1, ATTEMPTS + 1):
            if priority is TakePriority.BATCH and job.no_room is not None:
                await self._line_failed(job, number, job.no_room)
                return
            if place is not None:
                await place.again()
            await self._recorded(self.store.start_render, job.script_id, number, render, runner=self.runner)
            line.row.render = render
            line.row.attempts += 1
            job.announced_done = False
            job.log.emit("line", job.line_view(number))
            job.emit_progress()
            try:
                done = await render_line(
                    self.state,
                    self.sessions,
                    job.session_id,
                    job.script,
                    line.cue,
                    render,
                    priority,
                    None if place is None else place.release,
                )
            except LineInterrupted:
                log.info("script %s line %d: interrupted (%s); it stays queued", job.log_id, number, render["take"])
                return
            except LineNoRoom as failure:
                log.warning("script %s line %d: its take cannot be kept: %s", job.log_id, number, failure)
                if priority is TakePriority.BATCH:
                    job.no_room = str(failure)
                await self._line_failed(job, number, str(failure))
                return
            except LineFailed as failure:
                log.warning("script %s line %d, attempt %d: %s", job.log_id, number, attempt, failure)
                if attempt < ATTEMPTS:
                    continue
                await self._line_failed(job, number, str(failure))
                return
            text = None if done.text == line.cue.text else done.text
            instruction = None if done.instruction == job.script.instruction_for(line.cue) else done.instruction
            await self._recorded(
                self.store.finish_line, job.script_id, number, take_id=done.take_id, seed=done.seed,
                n_frames=done.n_frames, text=text, instruction=instruction, runner=self.runner,
            )  # fmt: skip
            line.row = LineRow(
                number, DONE, done.seed, done.take_id, done.n_frames, text, instruction, line.row.attempts
            )
            self._emit_line(job, number)
            await self.words.after_render(job.session_id, done.take_id)  # the script is done once they are kept
            return

    async def _recorded(self, call: Any, *args: Any, **kwargs: Any) -> None:
        """A write to the script's rows; rows gone mean its session was deleted (the cascade took them)."""
        try:
            await asyncio.to_thread(call, *args, **kwargs)
        except ProtocolError as err:
            if err.code is ErrorCode.NOT_FOUND:
                raise SessionGone(err.message) from None
            raise

    async def _line_failed(self, job: Job, number: int, reason: str) -> None:
        line = job.lines[number]
        keep = line.row.take_id is not None  # a retake of a done line failed: the line keeps its take
        message = f"the retake failed: {reason}" if keep else reason
        await self._recorded(self.store.fail_line, job.script_id, number, message, keep_take=keep, runner=self.runner)
        line.row.render = None
        line.row.error = message
        if not keep:
            line.row.status = FAILED
        self._emit_line(job, number)

    def _emit_line(self, job: Job, number: int) -> None:
        # The line's task is still registered while this runs; the event shows where it ended.
        view = job.line_view(number)
        view["status"] = job.lines[number].row.status
        job.log.emit("line", view)

    def _after_line(self, job: Job) -> None:
        """Progress after a line ended; ``done`` once nothing is left to render or rendering."""
        if job.failure is not None or self._jobs.get(job.script_id) is not job:
            return
        job.emit_progress()
        self._release_when_idle(job)
        if not job.tasks and job.runner is None and not job.pending_work and not job.announced_done:
            job.announced_done = True
            body = job.progress()
            body["duration_sec"] = job.progress()["audio_sec"]
            job.log.emit("done", body)
            log.info("script %s done: %d lines, %d failed", job.log_id, body["lines_done"], body["lines_failed"])

    async def _session_gone(self, job: Job, message: str) -> None:
        log.warning("script %s: its session is gone (%s); the render stops", job.log_id, message)
        job.failure = "the session was deleted"
        with contextlib.suppress(ProtocolError):
            await asyncio.to_thread(self.store.fail_script, job.script_id, job.failure)
        job.log.emit("error", {"code": ErrorCode.NOT_FOUND.value, "message": job.failure})
        job.log.close()
        if self._jobs.get(job.script_id) is job:
            del self._jobs[job.script_id]  # its rows went with the session

    # ------------------------------------------------------------------ directing a line
    async def retake(
        self,
        script_id: str,
        number: int,
        *,
        client: str,
        text: str | None = None,
        instruction: str | None = None,
        seed: int | None = None,
        frame: int = 0,
    ) -> Job:
        """Render line ``number`` again (interactive priority); overrides as for a seek: ``text`` and
        ``instruction`` replace the line's (the whole instruction), no ``seed`` means a new one, ``frame`` keeps
        that many frames of the line's take. The script renders here from now on (it is taken over)."""
        await self._take_over(script_id)
        job = await self.job(script_id)
        line = self._line(job, number)
        if job.failure is not None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"the script failed ({job.failure})", field="script")
        if frame and (line.row.take_id is None or frame > line.row.n_frames):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"frame {frame} is past the {line.row.n_frames} frames of line {number}'s take",
                field="frame",
            )
        await asyncio.to_thread(self.sessions.check_room, job.session_id)
        self.state.client_takes.acquire(client)  # a retake someone waits on counts like their other takes
        try:
            render = {
                "take": new_take_id(),
                "seed": seed if seed is not None else random_seed(),
                "text": text if text is not None else job.text_of(number),
                "instruction": instruction if instruction is not None else job.instruction_of(number),
                "parent": line.row.take_id,
                "frame": frame,
            }
            running = job.tasks.get(number)
            if running is not None:
                running.cancel()  # the newest direction wins
                await asyncio.wait([running], timeout=CLOSE_TIMEOUT_SEC)
            await asyncio.to_thread(self.store.queue_render, job.script_id, number, render, runner=self.runner)
            line.row.render = render
        except BaseException:
            self.state.client_takes.release(client)
            raise
        task = self._spawn(self._retake_line(job, number, client), f"retake-{script_id}-{number}")
        job.tasks[number] = task
        self._run_rest(job)
        return job

    def _run_rest(self, job: Job) -> None:
        """Render the lines still waiting (another front end was rendering them until this one took over)."""
        if any(n not in job.tasks and line.needs_render for n, line in job.lines.items()):
            self._run(job)

    async def _take_over(self, script_id: str) -> None:
        """Hold the script's lease, whoever held it (a director works on it through this front end now)."""
        if script_id not in self._held:
            await asyncio.to_thread(self.store.claim, script_id, self.runner, LEASE_SEC, take_over=True)
            await self._load(script_id, fresh=True)  # what the front end that had it recorded, before writing
            self._held.add(script_id)

    async def _retake_line(self, job: Job, number: int, client: str) -> None:
        try:
            await self._render(job, number, TakePriority.INTERACTIVE)
        except SessionGone as gone:
            await self._session_gone(job, str(gone))
        except LeaseLost:
            await self._moved(job.script_id)
        except StoreUnavailable:  # the retake stays queued in the database; resumed once it is back
            log.warning("script %s line %d: the session store is unavailable; the retake waits for it", job.log_id,
                        number)  # fmt: skip
        except Exception:  # a bug must not leave the line rendering forever
            log.exception("script %s line %d: retake failed", job.log_id, number)
            with contextlib.suppress(SessionGone):
                await self._line_failed(job, number, "internal error")
        finally:
            self.state.client_takes.release(client)
            if job.tasks.get(number) is asyncio.current_task():
                del job.tasks[number]
            self._after_line(job)

    async def accept(self, script_id: str, number: int, take_id: str) -> Job:
        """Make a take of the script's session line ``number``'s take (one directed in the studio)."""
        await self._take_over(script_id)
        job = await self.job(script_id)
        line = self._line(job, number)
        take: StoredTake = await asyncio.to_thread(self.sessions.get_take, job.session_id, take_id)
        if take.channels != 1:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "a script's lines are mono; this take is stereo", field="take")
        running = job.tasks.get(number)
        if running is not None:
            running.cancel()  # the director chose
            await asyncio.wait([running], timeout=CLOSE_TIMEOUT_SEC)
        text = str(take.request.get("text", line.cue.text))
        instruction = str(take.request.get("instruction", ""))
        text_col = None if text == line.cue.text else text
        instruction_col = None if instruction == job.script.instruction_for(line.cue) else instruction
        await asyncio.to_thread(
            self.store.finish_line, job.script_id, number, take_id=take.take_id, seed=take.seed,
            n_frames=take.n_frames, text=text_col, instruction=instruction_col, runner=self.runner,
        )  # fmt: skip
        line.row = LineRow(
            number, DONE, take.seed, take.take_id, take.n_frames, text_col, instruction_col, line.row.attempts
        )
        job.announced_done = False
        self._emit_line(job, number)
        self._run_rest(job)
        self._after_line(job)
        self.words.in_background(job.session_id, take.take_id)  # a studio take may have been made without words
        return job

    @staticmethod
    def _line(job: Job, number: int) -> LineState:
        line = job.lines.get(number)
        if line is None:
            raise ProtocolError(
                ErrorCode.NOT_FOUND, f"the script has lines 1 to {len(job.lines)}, not {number}", field="line"
            )
        return line

    async def words_of(self, session_id: str, timeline: Timeline) -> dict[int, list[WordTime]]:
        """The words of each line an export places (by line number, timed from its take's sample 0): stored with
        the take, else aligned now when the server has an aligner (bounded; :mod:`moss_rt.scripts.words`)."""
        return await self.words.of_lines(session_id, timeline.placed)

    # ------------------------------------------------------------------ events
    def listen(self, job: Job, last_event_id: str | None) -> tuple[Any, list[Any]]:
        """A listener of the job's events and what to send first: the missed events, or a ``state`` snapshot."""
        snapshot = job.log.snapshot_event(job.view())
        listener, missed = job.log.subscribe(last_event_id)
        return listener, missed if missed is not None else [snapshot]


__all__ = ["DONE", "FAILED", "PENDING", "EventLog", "ScriptService", "not_found"]
