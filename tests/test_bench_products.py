"""Smoke test of bench/per_example_products.py on a tiny GPT-2: the timed per-example products
and weight gradients are the computations they claim to be, and the JSON summary is complete."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from _bench import load_bench as _load  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return _load("per_example_products")


def test_products_sum_to_the_weight_gradients(bench):
    im = bench.im
    shape = im.tiny_config().gpt2
    model = bench.build_gpt2(shape, 0, "cpu")
    shapes = bench.weight_shapes(model)
    # every Conv1D of each block (4) and the lm_head, as (out, in) of the matrix
    assert len(shapes) == 4 * shape.num_layers + 1
    assert shapes[-1] == ("lm_head", shape.vocab_size, shape.width)
    assert ("transformer.h.0.mlp.c_fc", 4 * shape.width, shape.width) in shapes
    factors = bench.make_factors(shapes, shape.batch_size, shape.seq_len, 0, "cpu")
    in_out = [n != "lm_head" for n, _, _ in shapes]  # Conv1D: the engine's (in, out) buffer
    prod, wgrad = bench.products_step(factors, in_out=in_out), bench.wgrad_step(factors)
    prod()
    prod()  # accumulates: two extra states with alpha 0.5 each = one full product
    wgrad()
    for buf, ref, (_, o, i), (G, X), t in zip(prod.bufs, wgrad.out, shapes, factors, in_out):
        assert buf.shape == (shape.batch_size, o * i)
        per_example = (buf.view(shape.batch_size, i, o).transpose(1, 2) if t
                       else buf.view(shape.batch_size, o, i))
        torch.testing.assert_close(per_example.sum(0), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(per_example[1], G[1].T @ X[1], rtol=1e-4, atol=1e-4)


def test_last_line_is_json(bench, capsys):
    bench.main(["--tiny", "--seq-lens", "8,16", "--rounds", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shape = bench.im.tiny_config().gpt2
    d, V, L = shape.width, shape.vocab_size, shape.num_layers
    per_token = L * (3 * d * d + d * d + 4 * d * d + 4 * d * d) + V * d
    assert [r["T"] for r in summary["rows"]] == [8, 16]
    for r in summary["rows"]:
        assert r["gmacs"] == pytest.approx(shape.batch_size * r["T"] * per_token / 1e9)
        for k in ("nonprivate_s", "wgrad_s", "products_s", "products_over_wgrad"):
            assert r[k] > 0, k
        assert r["implied_marginal_floor"] == pytest.approx(
            1 + (r["products_s"] - r["wgrad_s"]) / r["nonprivate_s"])
