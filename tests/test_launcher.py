"""The tests' launcher (tests/fork_launcher.py) starts ranks as torchrun would."""

import json
import time

from distributed import run_workers


def test_each_rank_starts_as_a_new_process_of_a_torchrun_launch(tmp_path):
    run_workers("launch_worker.py", 2, str(tmp_path), "report", env={"PIPETX_PROBE": "seen"})
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["RANK"] == report["LOCAL_RANK"] == str(rank) and report["WORLD_SIZE"] == "2"
        assert report["group_rank"] == rank and report["group_size"] == 2
        assert report["lightning_rank"] == rank  # rank_zero_only, as Lightning sets it on import
        assert report["TORCHELASTIC_RUN_ID"] and report["PIPETX_PROBE"] == "seen"
        assert report["main"] == "__main__" and report["argv"] == [str(tmp_path), "report"]
    # seeds drawn from the system, as in new processes: no two ranks draw alike
    assert reports[0]["torch_draw"] != reports[1]["torch_draw"]
    assert reports[0]["python_draw"] != reports[1]["python_draw"]


def test_a_failing_rank_ends_the_launch_and_its_peers(tmp_path):
    start = time.monotonic()
    output = run_workers("launch_worker.py", 2, str(tmp_path), "fail", expect_failure=True, timeout=120)
    assert time.monotonic() - start < 60  # rank 0 would wait 600 s
    assert "ValueError: rank 1 stops here" in output
