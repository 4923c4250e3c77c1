"""bench/e2e_finetune_regime.py: the public/private split of the E2E training CSV keeps every
row, puts each meaning representation (MR) in exactly one half, and the fine-tuning runs see
the same expected batch as E2E-small."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from _bench import load_bench
from dptrain.data.lm import read_e2e_csv

DEVSET = Path(__file__).resolve().parents[2] / "shared" / "data" / "e2e" / "devset.csv"


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_split_is_disjoint_by_mr_and_keeps_every_row(tmp_path):
    bench = load_bench("e2e_finetune_regime")
    rows = [{"mr": f"name[{m}]", "ref": f"ref {m} {k}, with a comma"}
            for m in "ABCDE" for k in range(1 + "ABCDE".index(m))]
    mrs = {r["mr"] for r in rows}
    src = tmp_path / "devset.csv"
    with open(src, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["mr", "ref"])
        w.writeheader()
        w.writerows(rows)
    counts = bench.split_by_mr(src, tmp_path / "out", public_mr=True)
    pub, priv = _read(tmp_path / "out" / "public.csv"), _read(tmp_path / "out" / "private.csv")
    # sorted MRs A..E alternate: A, C, E public (1 + 3 + 5 rows), B, D private (2 + 4 rows)
    assert {r["mr"] for r in pub} == {"name[A]", "name[C]", "name[E]"}
    assert {r["mr"] for r in priv} == {"name[B]", "name[D]"}
    assert counts == {"public": 9, "private": 6}
    as_tuples = lambda rs: sorted(tuple(r.items()) for r in rs)  # noqa: E731
    assert as_tuples(pub + priv) == as_tuples(rows)
    # deterministic: a second split writes the same files
    bench.split_by_mr(src, tmp_path / "again", public_mr=True)
    assert _read(tmp_path / "again" / "public.csv") == pub
    # by default the public half keeps only the references: the same rows under one MR, which
    # names none of the data's, and which the E2E loader reads (it refuses an empty MR)
    bench.split_by_mr(src, tmp_path / "refs")
    refs = _read(tmp_path / "refs" / "public.csv")
    assert [r["ref"] for r in refs] == [r["ref"] for r in pub]
    assert {r["mr"] for r in refs} == {bench.PUBLIC_MR} and bench.PUBLIC_MR not in mrs
    assert _read(tmp_path / "refs" / "private.csv") == priv
    read = read_e2e_csv(tmp_path / "refs" / "public.csv", "data.train_file")
    assert read == ([bench.PUBLIC_MR] * len(pub), [r["ref"] for r in pub])


def test_split_refuses_a_csv_without_mr_and_ref(tmp_path):
    bench = load_bench("e2e_finetune_regime")
    src = tmp_path / "testset.csv"
    src.write_text("MR\nname[A]\n")
    with pytest.raises(SystemExit, match="mr, ref"):
        bench.split_by_mr(src, tmp_path / "out")
    assert not (tmp_path / "out" / "public.csv").exists()


@pytest.mark.skipif(not DEVSET.exists(), reason="needs ../shared/data/e2e/devset.csv")
def test_real_devset_halves_and_their_sample_rates(tmp_path):
    bench = load_bench("e2e_finetune_regime")
    counts = bench.split_by_mr(DEVSET, tmp_path, public_mr=True)
    assert counts["public"] + counts["private"] == 4672
    assert not ({r["mr"] for r in _read(tmp_path / "public.csv")}
                & {r["mr"] for r in _read(tmp_path / "private.csv")})
    for n in counts.values():
        assert abs(bench.sample_rate_for(n, 32) * n - 32) < 1e-3
