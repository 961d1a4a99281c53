"""lenskit.factored.FactoredMatrix against TransformerLens 4.3's own FactoredMatrix on the same random matrices,
and against torch.linalg on the formed product AB."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from fixtures import close
from references import transformer_lens_4_3

from lenskit.factored import FactoredMatrix

F64 = dict(dtype=torch.float64)


def tl_factored():
    transformer_lens_4_3()
    from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactored

    return TLFactored


def factors(lead=(3, 4), ldim=12, mdim=5, rdim=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, ldim, mdim, generator=g, **F64), torch.randn(*lead, mdim, rdim, generator=g, **F64)


close = partial(close, atol=1e-10, rtol=1e-10)  # float64 products: the shared check, to float64 rounding


def same_as_tl(ours: FactoredMatrix, theirs) -> None:
    """Same shape, dims and product as TransformerLens's FactoredMatrix."""
    assert type(ours) is FactoredMatrix
    assert ours.shape == theirs.shape and ours.ndim == theirs.ndim
    assert (ours.ldim, ours.mdim, ours.rdim) == (theirs.ldim, theirs.mdim, theirs.rdim)
    close(ours.A, theirs.A)
    close(ours.B, theirs.B)


@pytest.mark.parametrize("shape", [((), 7, 3, 9), ((4,), 6, 8, 6), ((2, 3), 10, 4, 10)])
def test_product_transpose_and_dims_match_transformer_lens(shape):
    TL = tl_factored()
    lead, l, m, r = shape
    A, B = factors(lead, l, m, r)
    ours, theirs = FactoredMatrix(A, B), TL(A, B)
    same_as_tl(ours, theirs)
    close(ours.AB, A @ B)
    same_as_tl(ours.T, theirs.T)
    close(ours.T.AB, (A @ B).transpose(-2, -1))
    assert ours.pair[0] is ours.A and ours.pair[1] is ours.B
    assert ours.has_leading_dims == theirs.has_leading_dims == bool(lead)
    if l == r:
        close(ours.BA, theirs.BA)
    else:
        with pytest.raises(ValueError, match="square"):
            ours.BA


def test_leading_dims_broadcast_like_transformer_lens():
    TL = tl_factored()
    A, _ = factors((3, 1), 6, 2, 6)
    _, B = factors((1, 4), 6, 2, 6, seed=1)
    ours, theirs = FactoredMatrix(A, B), TL(A, B)
    assert ours.shape == (3, 4, 6, 6)
    same_as_tl(ours, theirs)
    close(ours.AB, A @ B)


def test_svd_matches_linalg_and_transformer_lens():
    TL = tl_factored()
    A, B = factors((3, 4), 12, 5, 12)
    ours, theirs = FactoredMatrix(A, B), TL(A, B)
    U, S, V = ours.svd()
    assert U.shape == (3, 4, 12, 5) and S.shape == (3, 4, 5) and V.shape == (3, 4, 12, 5)
    close(S, torch.linalg.svdvals(A @ B)[..., :5])
    close(S, theirs.S)
    close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), A @ B)
    close(U.transpose(-2, -1) @ U, torch.eye(5, **F64).expand(3, 4, 5, 5))
    # singular vectors agree up to one sign per vector (the singular values of random matrices are distinct)
    sign = torch.sign((U * theirs.U).sum(-2))
    close(U * sign[..., None, :], theirs.U)
    close(V * sign[..., None, :], theirs.V)
    with pytest.warns(DeprecationWarning):
        tl_vh = theirs.Vh
    close(ours.Vh, V)  # TransformerLens 3's Vh is V itself
    close(ours.Vh * sign[..., None, :], tl_vh)
    assert ours.svd() is ours.svd()  # computed once


def test_norm_eigenvalues_collapse_and_make_even_match():
    TL = tl_factored()
    A, B = factors((2, 3), 8, 4, 8)
    ours, theirs = FactoredMatrix(A, B), TL(A, B)
    close(ours.norm(), torch.linalg.matrix_norm(A @ B))
    close(ours.norm(), theirs.norm())
    ev = ours.eigenvalues
    assert ev.shape == (2, 3, 4) and ev.is_complex()
    full = torch.linalg.eigvals(A @ B)  # 8 eigenvalues, 4 of them zero
    for i in range(2):
        for j in range(3):
            big = full[i, j][full[i, j].abs() > 1e-8]
            assert torch.allclose(big.abs().sort().values, ev[i, j].abs().sort().values, atol=1e-9)
    close(ev.abs().sort(dim=-1).values, theirs.eigenvalues.abs().sort(dim=-1).values)
    even = ours.make_even()
    close(even.AB, A @ B)
    close(even.A.transpose(-2, -1) @ even.A, torch.diag_embed(ours.S))  # A's columns orthogonal, norms sqrt(S)
    close(ours.collapse_l().abs(), theirs.collapse_l().abs())  # the same up to each vector's sign
    close(ours.collapse_r().abs(), theirs.collapse_r().abs())
    close(ours.U @ ours.collapse_l(), A @ B)
    close(ours.collapse_r() @ ours.V.transpose(-2, -1), A @ B)


@pytest.mark.parametrize("ldim,mdim", [(12, 5), (4, 9)])
def test_matmul_with_tensors_and_factored_matrices(ldim, mdim):
    TL = tl_factored()
    A, B = factors((3,), ldim, mdim, ldim)
    ours, theirs = FactoredMatrix(A, B), TL(A, B)
    g = torch.Generator().manual_seed(5)
    right = torch.randn(ldim, 7, generator=g, **F64)
    left = torch.randn(6, ldim, generator=g, **F64)
    vec = torch.randn(ldim, generator=g, **F64)
    same_as_tl(ours @ right, theirs @ right)
    close((ours @ right).AB, A @ B @ right)
    same_as_tl(left @ ours, left @ theirs)
    close((left @ ours).AB, left @ A @ B)
    close(ours @ vec, theirs @ vec)
    close(ours @ vec, (A @ B @ vec[:, None]).squeeze(-1))
    close(vec @ ours, vec @ theirs)
    close(vec @ ours, (vec @ (A @ B)))
    other_A, other_B = factors((3,), ldim, 3, ldim, seed=2)
    both = ours @ FactoredMatrix(other_A, other_B)
    same_as_tl(both, theirs @ TL(other_A, other_B))
    close(both.AB, A @ B @ other_A @ other_B)
    with pytest.raises(ValueError, match="rows"):
        ours @ torch.randn(ldim + 1, 2, **F64)
    with pytest.raises(ValueError, match="columns"):
        torch.randn(2, ldim + 1, **F64) @ ours


def test_scalar_multiplication():
    TL = tl_factored()
    A, B = factors((2,), 5, 3, 4)
    for c in (2.5, 3, torch.tensor(0.5, **F64)):
        for ours, theirs in ((FactoredMatrix(A, B) * c, TL(A, B) * c), (c * FactoredMatrix(A, B), c * TL(A, B))):
            same_as_tl(ours, theirs)
            close(ours.AB, (A @ B) * c)
    with pytest.raises(ValueError, match="scalar"):
        FactoredMatrix(A, B) * torch.ones(3, **F64)


INDICES = [(1,), (1, 2), (1, 2, 3), (1, 2, slice(0, 3), 4), (Ellipsis, 2), (Ellipsis, -1, -1), (0, Ellipsis, slice(2, 5)),
           (torch.tensor([0, 2]),), (slice(None), 3), (-1, -1, slice(1, None), -1)]


@pytest.mark.parametrize("idx", INDICES, ids=str)
def test_getitem_matches_transformer_lens_and_the_formed_product(idx):
    TL = tl_factored()
    A, B = factors((3, 4), 10, 5, 9)
    ours, theirs = FactoredMatrix(A, B)[idx], TL(A, B)[idx]
    same_as_tl(ours, theirs)


def test_getitem_rows_and_columns_index_the_product():
    A, B = factors((3, 4), 10, 5, 9)
    M = A @ B
    close(FactoredMatrix(A, B)[1, 2, 3:7, 4].AB, M[1, 2, 3:7, 4:5])
    close(FactoredMatrix(A, B)[..., -1].AB, M[..., -1:])
    with pytest.raises(IndexError, match="too many"):
        FactoredMatrix(A, B)[0, 0, 0, 0, 0]
    with pytest.raises(IndexError, match="unsqueeze"):
        FactoredMatrix(A, B)[None]


def test_unsqueeze_get_corner_repr():
    TL = tl_factored()
    A, B = factors((3, 4), 6, 2, 6)
    same_as_tl(FactoredMatrix(A, B).unsqueeze(1), TL(A, B).unsqueeze(1))
    close(FactoredMatrix(A, B).get_corner(2), TL(A, B).get_corner(2))
    close(FactoredMatrix(A, B).get_corner(), (A @ B)[:3, :3, :3, :3])
    assert repr(FactoredMatrix(A, B)) == repr(TL(A, B))


def test_bad_factors_are_refused_in_one_line():
    with pytest.raises(ValueError, match="inner size"):
        FactoredMatrix(torch.randn(4, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="broadcast"):
        FactoredMatrix(torch.randn(2, 4, 3), torch.randn(5, 3, 4))
    with pytest.raises(ValueError, match="2-d"):
        FactoredMatrix(torch.randn(4), torch.randn(4, 2))


def test_half_precision_spectra_are_computed_in_float32():
    A, B = factors((), 6, 3, 6)
    fm = FactoredMatrix(A.to(torch.bfloat16), B.to(torch.bfloat16))
    assert fm.S.dtype == torch.float32 and fm.eigenvalues.dtype == torch.complex64
    torch.testing.assert_close(fm.S.double(), torch.linalg.svdvals(A @ B)[:3], atol=0.1, rtol=0.02)


def test_namespace_path():
    from lenskit.transformer_lens.FactoredMatrix import FactoredMatrix as Exported

    assert Exported is FactoredMatrix
