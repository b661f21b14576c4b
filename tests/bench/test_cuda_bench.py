"""The GPU decode bench runs end to end on CPU (a tiny random model), so it works the day a device is lent;
asking for CUDA where there is none is refused with the way out."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.cuda_bench import main


def test_a_cpu_smoke_run_times_both_sides_at_each_batch_and_the_roofline(tmp_path, capsys):
    out = tmp_path / "cuda_bench.json"
    assert main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--batches", "1", "3",
                 "--tokens", "6", "--reps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["decode"]) == {"1", "3"}
    for d in r["decode"].values():
        assert d["engine_step_ms"] > 0 and d["hf_step_ms"] > 0
        assert d["engine_vs_hf"] == pytest.approx(d["hf_step_ms"] / d["engine_step_ms"])
    assert 0 < r["roofline"]["decode_b1_vs_roofline"] == pytest.approx(
        r["roofline"]["step_ms"] / r["decode"]["1"]["engine_step_ms"])
    assert "decode batch 3" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device here")
def test_cuda_where_there_is_none_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cpu" in capsys.readouterr().err
