"""Document-causal attention (packed windows): no attention weight crosses a document boundary, the
flex block mask is the SDPA mask, and a packed window's loss is the sum of its documents' losses."""

import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig, build_model
from models.config import preset
from parallel.layers import DocumentMask, document_attention, document_ids, document_kernel

# three documents in row 0 (the first cut by the window start), one in row 1
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(12))])


def test_document_ids_count_the_restarts_and_the_kernel_is_picked_per_device():
    assert document_ids(POSITIONS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0] * 12]
    assert [document_kernel(*a) for a in (("cpu", 64), ("cuda", 64), ("cuda", 128), ("cuda", 96), ("cuda", 8))] == [
        "sdpa", "flex", "flex", "sdpa", "sdpa"
    ]  # fmt: skip


def test_no_attention_weight_crosses_a_document_boundary():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = (torch.randn(2, 2, 12, 8, generator=g, requires_grad=True) for _ in range(2))  # GQA: 2 kv heads
    mask = DocumentMask(POSITIONS)
    out = document_attention(q, k, v, mask, kernel="sdpa")
    ids = mask.ids
    for row in range(2):
        for i in range(12):  # d out[i] / d (k, v)[j] is zero exactly where j is another document or later
            k.grad = v.grad = None
            out[row, :, i].sum().backward(retain_graph=True)
            allowed = (ids[row] == ids[row, i]) & (torch.arange(12) <= i)
            for t in (k, v):
                reach = t.grad[row].abs().sum(dim=(0, 2)) > 0
                assert torch.equal(reach, allowed) if t is v else not (reach & ~allowed).any()
            assert k.grad[1 - row].abs().sum() == 0  # nor into the other sample
    for a, b in ((0, 3), (3, 8), (8, 12)):  # each document alone, plain causal attention
        alone = F.scaled_dot_product_attention(
            q[:1, :, a:b], k[:1, :, a:b], v[:1, :, a:b], is_causal=True, enable_gqa=True
        )
        torch.testing.assert_close(out[:1, :, a:b], alone, rtol=0, atol=1e-6)


def test_the_flex_block_mask_is_the_sdpa_mask():
    """flex attention in eager mode (CPU forward; its kernel under torch.compile is the CUDA path)."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(3))
    mask = DocumentMask(POSITIONS)
    dense = mask.block_mask().to_dense()  # [b, h, q blocks, kv blocks]: blocks any pair of which may attend
    assert dense.shape[0] == 2
    flex = flex_attention(q, k, v, block_mask=mask.block_mask())
    torch.testing.assert_close(flex, document_attention(q, k, v, mask, kernel="sdpa"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(  # learned positions / RoPE; recomputed cores and blocks see the same mask
    "arch, checkpointing",
    [("gpt", "none"), ("gpt", "full"), ("llama", "none"), ("llama", "selective"), ("mla", "selective")],
)
def test_a_packed_window_loss_is_the_sum_of_its_documents_losses(arch, checkpointing):
    if arch == "mla":  # DeepSeek's latent attention (its dense layers: routing is per token either way)
        cfg = preset("deepseek_tiny", n_layers=2, moe_first_dense=2, vocab_size=50, seq_len=12)
        cfg = cfg.replace(activation_checkpointing=checkpointing)
    else:
        cfg = ModelConfig(
            arch=arch, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2 if arch == "llama" else None, d_ff=64,
            vocab_size=50, seq_len=12, activation_checkpointing=checkpointing,
        )  # fmt: skip
    model = build_model(cfg, seed=2)
    g = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    packed = model.loss(model(ids, positions=POSITIONS), targets) * ids.numel()  # the mean over tokens, as a sum
    packed.backward()
    first = next(model.blocks["0"].attn.parameters())
    packed_grad = first.grad.clone()
    model.zero_grad()
    total = torch.zeros(())
    for row, cuts in ((0, (0, 3, 8, 12)), (1, (0, 12))):
        for a, b in zip(cuts, cuts[1:]):
            x, y = ids[row : row + 1, a:b], targets[row : row + 1, a:b]
            total = total + model.loss(model(x), y) * x.numel()
    total.backward()
    torch.testing.assert_close(packed, total, rtol=0, atol=1e-5 * ids.numel())
    torch.testing.assert_close(packed_grad, first.grad, rtol=1e-4, atol=1e-5)
    concat = model.loss(model(ids), targets) * ids.numel()
    assert (concat - packed).abs() > 1e-3  # the mask and positions change the loss: the test can fail
