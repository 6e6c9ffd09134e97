"""Child-process hygiene: SIGTERM is a normal exit, so a child's multiprocessing semaphores are released."""

import subprocess
import sys
import textwrap

SUITE = "unit-cpu"
EST_TIME = 4

# A spawned child that, like a scheduler, calls watch_parent() and holds a multiprocessing lock (a named
# semaphore registered with the resource tracker; tqdm's write lock is one), terminated by its parent.
SCRIPT = textwrap.dedent("""
    import multiprocessing as mp

    def child(writer):
        from sglite.srt.managers.subprocess_watchdog import watch_parent
        watch_parent()
        lock = mp.get_context("spawn").Lock()
        writer.send("ready")
        import time
        while True:
            time.sleep(1)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=child, args=(writer,), daemon=True)
        proc.start()
        assert reader.recv() == "ready"
        proc.terminate()
        proc.join(10)
        print("exitcode", proc.exitcode)
""")


def test_a_terminated_child_exits_cleanly_and_leaks_no_semaphore(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exitcode 0" in done.stdout  # SystemExit(0), not death by signal (-15)
    assert "leaked semaphore" not in done.stderr
