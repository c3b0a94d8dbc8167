"""Rows of a VNNI-ordered table read back as plain rows (vnni_rows in vnni_linear.c): the embedding lookup of a
table its tied head reordered, against F.embedding on the table before the reordering."""
import pytest
import torch
import torch.nn.functional as F

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.kernels import build, cpu_linear
from services.model_worker.model.layers.embedding import VocabParallelEmbedding

pytestmark = pytest.mark.skipif("avx512_bf16" not in build.cpu_features(), reason="the CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def vnni():
    library = cpu_linear.load_vnni()
    assert library is not None, "the VNNI kernels must build and run on a CPU with AVX512-BF16"
    return library


@pytest.mark.parametrize("vocab,hidden", [(32, 64), (160, 96), (4096, 1024)])
def test_rows_equal_the_plain_tables_rows(vnni, vocab, hidden):
    gen = torch.Generator().manual_seed(vocab + hidden)
    table = torch.randn(vocab, hidden, generator=gen).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, table.clone())
    ids = torch.cat([torch.tensor([0, vocab - 1, 15, 16, 17]), torch.randint(0, vocab, (40,), generator=gen)])
    assert torch.equal(cpu_linear.vnni_rows(vnni, packed, ids), F.embedding(ids, table))
    grid = ids[:40].view(5, 8)  # leading shapes kept, as F.embedding keeps them
    assert torch.equal(cpu_linear.vnni_rows(vnni, packed, grid), F.embedding(grid, table))


def test_ids_outside_the_table_raise_and_write_nothing(vnni):
    packed = cpu_linear.vnni_pack_(vnni, torch.randn(64, 32).bfloat16())
    for bad in (64, -1):
        with pytest.raises(IndexError):
            cpu_linear.vnni_rows(vnni, packed, torch.tensor([3, bad]))


class Head(torch.nn.Module):
    """What share_with_head reads of a tied head whose method reordered the shared weight."""

    def __init__(self, weight: torch.nn.Parameter, library):
        super().__init__()
        self.vnni, self.vnni_weight = library, weight


def test_embedding_of_a_reordered_table_takes_the_kernel_with_the_same_rows(vnni):
    embed = VocabParallelEmbedding(256, 64, TensorParallel())
    embed.weight.data.copy_(torch.randn(256, 64).bfloat16())
    embed.weight.data = embed.weight.data.bfloat16()
    plain = embed.weight.detach().clone()
    packed = torch.nn.Parameter(cpu_linear.vnni_pack_(vnni, embed.weight.data), requires_grad=False)
    embed.share_with_head(Head(packed, vnni))
    assert embed.vnni is vnni and embed.weight.dim() == 4
    ids = torch.randint(0, 256, (3, 7))
    assert torch.equal(embed(ids), F.embedding(ids, plain))
    embed.vnni = None  # the torch indexing it replaces gives the same rows
    assert torch.equal(embed(ids), F.embedding(ids, plain))
