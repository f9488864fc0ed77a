"""lib.sh's `bounded` without a GPU (Python 3 standard library, bash and coreutils' timeout):

    python3 -B -m unittest discover -s benches/gpu/tests

A bench script that is stopped must stop the run it waits for: `timeout` puts that run in a
process group of its own, so a signal to the script's group alone leaves it running (a PyTorch
profile went on holding 28.5 GiB of the card while the next model was measured).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.path.join(os.path.dirname(HERE), "lib.sh")
sys.dont_write_bytecode = True

# A script that runs one long command the way the bench scripts do; $1 names the file where
# the command writes its process id.
SCRIPTS = {
    "bounded": """set -uo pipefail
source "{lib}"
bounded 60 sh -c 'echo $$ > "$0"; exec sleep 30' "$1"
echo "the command ended: $?"
""",
    # As the scripts ran their commands before `bounded`, for contrast.
    "timeout": """set -uo pipefail
timeout --kill-after=10 60 sh -c 'echo $$ > "$0"; exec sleep 30' "$1"
echo "the command ended: $?"
""",
}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return ") Z " not in stat.read()


def run_and_stop(how, stop):
    """Runs the script with `how` (`bounded` or `timeout`), stops it as `stop` says, and
    returns the command's process id and whether it outlived the script by a second."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "script.sh")
        with open(script, "w") as f:
            f.write(SCRIPTS[how].format(lib=LIB))
        pid_file = os.path.join(tmp, "pid")
        if stop == "outer timeout":
            proc = subprocess.Popen(["timeout", "1", "bash", script, pid_file],
                                    stdout=subprocess.DEVNULL)
            proc.wait(timeout=20)
        else:
            proc = subprocess.Popen(["bash", script, pid_file], stdout=subprocess.DEVNULL)
            deadline = time.time() + 10
            while not os.path.exists(pid_file) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            proc.send_signal(stop)
            proc.wait(timeout=20)
        with open(pid_file) as f:
            pid = int(f.read())
        time.sleep(1.0)
        return pid, alive(pid)


class Bounded(unittest.TestCase):
    def test_a_stopped_script_stops_the_command_it_waits_for(self):
        # (how the script is stopped)
        for stop in ["outer timeout", signal.SIGTERM, signal.SIGINT, signal.SIGHUP]:
            with self.subTest(stop=stop):
                pid, survived = run_and_stop("bounded", stop)
                self.assertFalse(survived, f"process {pid} outlived the script")

    def test_without_it_the_command_outlives_an_outer_timeout(self):
        pid, survived = run_and_stop("timeout", "outer timeout")
        try:
            self.assertTrue(survived, "the bare timeout's command was stopped after all")
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    def test_the_command_keeps_the_scripts_input_and_its_status_comes_back(self):
        out = subprocess.run(
            ["bash", "-c", f'source "{LIB}"; bounded 5 cat; bounded 1 sleep 5; echo "rc $?"'],
            input="line\n", capture_output=True, text=True, timeout=30)
        self.assertEqual(out.stdout, "line\nrc 124\n")


if __name__ == "__main__":
    unittest.main()
