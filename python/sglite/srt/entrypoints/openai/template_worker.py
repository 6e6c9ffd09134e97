"""Render client-supplied chat templates in a worker process that is killed when it runs too long.

Only a server started with --trust-request-chat-template renders them at all. jinja2's sandbox
bounds what a template may call but not how long it runs (nested loops over ``range`` are enough to
spin for minutes), and a thread cannot be stopped, so the render runs in a spawned process: past the
time limit the process is killed, the request gets a 400, and the next render starts a fresh one.
The worker also caps its address space and the size of what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

# A chat template renders in milliseconds; seconds mean a loop or an attack.
RENDER_TIMEOUT_S = 5.0
# Address-space cap of the worker (Python + jinja2 + transformers' template utilities fit well inside).
WORKER_MEMORY_BYTES = 4 << 30
# How long a fresh worker may take to import what it needs.
WORKER_STARTUP_S = 30.0


class TemplateRenderError(ValueError):
    """A client template that failed, ran past the time limit or produced too much text."""


class TemplateWorker:
    """One spawned render process, reused across requests and replaced after a kill.

    Renders are serialized (a lock); the blocking wait runs in a thread so the event loop is free.
    """

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._proc: Optional[Any] = None
        self._conn: Optional[Any] = None

    async def render(self, template: str, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], max_chars: int) -> str:
        """The prompt text; raises TemplateRenderError (a 400 for the client) on failure or timeout."""
        return await asyncio.to_thread(self._render_blocking, template, messages, template_kwargs, max_chars)

    def _render_blocking(self, template: str, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], max_chars: int) -> str:
        with self._lock:
            self._ensure_started()
            self._conn.send((template, messages, template_kwargs, max_chars))
            if not self._conn.poll(self.timeout_s):
                logger.warning("killing the chat template worker (pid %s): a render ran past %g s", self._proc.pid, self.timeout_s)
                self._kill()
                raise TemplateRenderError(f"the chat template did not render within {self.timeout_s:g} s")
            try:
                ok, value = self._conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise TemplateRenderError("the chat template worker died while rendering (out of memory?)") from None
            if not ok:
                raise TemplateRenderError(value)
            return value

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._kill()
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child,), name="chat-template-worker", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # The worker says it is ready once its imports are done: start-up is not the template's time.
        if not parent.poll(WORKER_STARTUP_S):
            self._kill()
            raise TemplateRenderError(f"the chat template worker did not start within {WORKER_STARTUP_S:g} s")
        parent.recv()

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        """Stop the worker process."""
        with self._lock:
            self._kill()


def _worker_main(conn: Any) -> None:
    """Process entry: render (template, messages, kwargs, max_chars) requests until the pipe closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    from transformers.utils.chat_template_utils import render_jinja_template

    conn.send("ready")
    while True:
        try:
            template, messages, template_kwargs, max_chars = conn.recv()
        except (EOFError, OSError):
            return
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], chat_template=template, add_generation_prompt=True, **template_kwargs
            )
            text = rendered[0]
            if len(text) > max_chars:
                conn.send((False, f"the chat template rendered {len(text)} characters; the limit is {max_chars}"))
            else:
                conn.send((True, text))
        except MemoryError:
            conn.send((False, "the chat template ran out of memory"))
        except Exception as e:  # any template error is the client's: report it, keep serving
            conn.send((False, f"could not apply the chat template: {type(e).__name__}: {e}"))
