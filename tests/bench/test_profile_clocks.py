"""``benchmarks/profile/profile_clocks.py`` reads ``nvidia-smi``'s samples right on the CPU:
only the samples inside a timing window count, their medians are reported, and lines it cannot
parse (a header, a driver message, "[N/A]") or a missing sample file give NaN, not a crash."""

import math
import time
from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile" / "profile_clocks.py"


def _module():
    return load_script(SCRIPT)


def _stamp(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y/%m/%d %H:%M:%S"))


def test_samples_between_takes_the_medians_of_the_window_only(tmp_path):
    samples = tmp_path / "smi.csv"
    samples.write_text(
        "2026/12/05 21:50:11.900, 1980, 300.00\n"  # before the window
        "2026/12/05 21:50:12.100, 1755, 650.50\n"
        "2026/12/05 21:50:12.500, 1700, 690.25\n"
        "2026/12/05 21:50:12.900, 1650, 699.00\n"
        "2026/12/05 21:50:13.600, 1980, 120.00\n"  # after it
    )
    start = _stamp("2026/12/05 21:50:12")
    clock, power = _module().samples_between(samples, start, start + 1.0)
    assert (clock, power) == (1700.0, 690.25)


def test_unparsable_lines_and_a_missing_file_give_nan(tmp_path):
    module = _module()
    samples = tmp_path / "smi.csv"
    samples.write_text("timestamp, clocks.sm, power.draw\n2026/12/05 21:50:12.100, [N/A], 600\n")
    start = _stamp("2026/12/05 21:50:12")
    for path in (samples, tmp_path / "absent.csv"):
        clock, power = module.samples_between(path, start, start + 1.0)
        assert math.isnan(clock) and math.isnan(power)
