"""tests/lives.py, which several tests use instead of ``python script.py``: each life ends
as that process would, and sees its own argv, environment, directory and imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lives import Life, run_lives

SCRIPT = '''
import atexit, json, os, sys
from helper import VALUE   # found beside the script: sys.path[0] is its directory
atexit.register(lambda: print("atexit ran", flush=True))
what = sys.argv[1]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("LIFE"),
                  "main": __name__, "value": VALUE,
                  "library": "resilient_train" in sys.modules}), flush=True)
if what == "raise":
    raise ValueError("a bug in the script")
if what == "exit":
    sys.exit(134)
if what == "kill":
    os.kill(os.getpid(), 9)
'''


def test_each_life_ends_as_python_script_would(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "life.py"
    script.write_text(SCRIPT)
    (tmp_path / "scripts" / "helper.py").write_text("VALUE = 7\n")
    lives = [Life([str(script), what], dict(os.environ, LIFE=what), cwd=str(tmp_path))
             for what in ("ok", "raise", "exit", "kill")]
    got = run_lives(lives, preload=("json",))
    want = [subprocess.run([sys.executable, *life.argv], env=dict(life.env), cwd=life.cwd,
                           capture_output=True, text=True, check=False) for life in lives]
    assert [p.returncode for p in got] == [p.returncode for p in want] == [0, 1, 134, -9]
    for life, mine, theirs in zip(lives, got, want):
        assert mine.stdout == theirs.stdout, (life.argv, mine.stdout, theirs.stdout)
    assert '"library": false' in got[0].stdout and '"main": "__main__"' in got[0].stdout
    assert got[0].stdout.endswith("atexit ran\n")
    assert got[1].stderr.endswith("ValueError: a bug in the script\n"), got[1].stderr
    assert 'life.py", line 10, in <module>' in got[1].stderr
    # Together, the lives run side by side: each waits for the other's file.
    wait = "import os, sys, time\nopen(sys.argv[1], 'w').close()\n" \
           "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
    (tmp_path / "wait.py").write_text(wait)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    both = run_lives([Life([str(tmp_path / "wait.py"), a, b], dict(os.environ)),
                      Life([str(tmp_path / "wait.py"), b, a], dict(os.environ))],
                     together=True, timeout=30, preload=())
    assert [p.returncode for p in both] == [0, 0]
