"""RotaryEmbedding's per-forward lookup of cos/sin: shared by the layers of one forward, never carried into a CUDA
graph capture (a graph that reused a lookup made before it would rotate every replay by the warm-up's positions)."""

from __future__ import annotations

import torch

from banyan.layers import rotary
from banyan.layers.rotary import RotaryEmbedding


def rotate(rope, positions):
    q, k = torch.ones(len(positions), 2, 8), torch.ones(len(positions), 1, 8)
    return rope(positions, q, k)


def test_the_layers_of_one_forward_share_one_lookup():
    rope = RotaryEmbedding(8, 64)
    positions = torch.tensor([0, 5, 9])
    first = rope._cos_sin(positions, torch.float32)
    assert rope._cos_sin(positions, torch.float32)[0] is first[0]  # the same tensor object: one lookup
    assert rope._cos_sin(torch.tensor([0, 5, 9]), torch.float32)[0] is not first[0]  # a new forward looks up again


def test_a_lookup_made_before_a_graph_capture_is_not_reused_inside_it(monkeypatch):
    rope = RotaryEmbedding(8, 64)
    positions = torch.tensor([3, 4])
    capturing = [False]
    monkeypatch.setattr(rotary, "graph_capturing", lambda _: capturing[0])
    warm_up = rope._cos_sin(positions, torch.float32)
    capturing[0] = True  # the same batch object captured right after its warm-up run
    captured = rope._cos_sin(positions, torch.float32)
    assert captured[0] is not warm_up[0]  # looked up inside the capture, where the graph records it
    assert torch.equal(captured[0], warm_up[0])
    assert rope._cos_sin(positions, torch.float32)[0] is captured[0]  # the capture's later layers share its lookup


def test_rotation_matches_the_angles_of_each_position():
    rope = RotaryEmbedding(8, 64)
    q, _ = rotate(rope, torch.tensor([0, 7]))
    assert torch.equal(q[0], torch.ones(2, 8))  # position 0 rotates by nothing
    angles = 7 * rope.cos.new_tensor([1.0 / 10000 ** (i / 8) for i in range(0, 8, 2)])
    expected = torch.cat((angles.cos() - angles.sin(), angles.cos() + angles.sin()))
    torch.testing.assert_close(q[1, 0], expected)
