"""A matrix kept as the product of two factors, `M = A @ B`, as TransformerLens's `FactoredMatrix` means it.

A head's OV circuit `W_V @ W_O` is [d_model, d_model] but has rank at most d_head; kept as its two factors, products
with it stay cheap, and its SVD, norm and eigenvalues come from the factors (the d_model x d_model matrix is never
formed). Leading dimensions broadcast, so `model.OV` is one FactoredMatrix of shape [layer, head, d_model, d_model].

>>> OV = model.OV                      # A = W_V [layer, head, d_model, d_head], B = W_O [layer, head, d_head, d_model]
>>> OV.shape
torch.Size([6, 6, 192, 192])
>>> OV[1, 3].S.shape                   # singular values of layer 1 head 3's OV circuit, [d_head]
torch.Size([32])
>>> S = torch.linalg.svdvals(OV[1, 3].AB)   # the same, from the d_model x d_model product
>>> torch.allclose(OV[1, 3].S, S[:32], atol=1e-5)
True
>>> (model.W_E @ OV[1, 3]).AB.shape    # [d_vocab, d_model], still computed through the factors
torch.Size([4096, 192])

Names follow TransformerLens: `ldim` x `rdim` is the matrix's shape, `mdim` the inner (hidden) size.
"""

from __future__ import annotations

import numbers
from typing import Union

import torch

Scalar = Union[int, float, torch.Tensor]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 where it is 16-bit, since torch.linalg's SVD and eig have no 16-bit kernels."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class FactoredMatrix:
    """`M = A @ B` with A [..., ldim, mdim] and B [..., mdim, rdim]; the leading dimensions of A and B broadcast.

    `M @ X` and `X @ M` (X a tensor or another FactoredMatrix) stay factored, keeping the smaller inner size;
    a vector on either side gives a tensor. `M * c` scales by a scalar. `AB` forms the product.
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        if A.ndim < 2 or B.ndim < 2:
            raise ValueError(f"FactoredMatrix needs A [..., ldim, mdim] and B [..., mdim, rdim], both at least 2-d; "
                             f"got A {tuple(A.shape)} and B {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"FactoredMatrix factors must share the inner size: A's last dim is {A.shape[-1]}, "
                             f"B's second-to-last is {B.shape[-2]} (A {tuple(A.shape)}, B {tuple(B.shape)})")
        try:
            lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(f"FactoredMatrix factors' leading dims do not broadcast: A {tuple(A.shape)}, "
                             f"B {tuple(B.shape)}; make them equal or 1") from None
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.has_leading_dims = A.ndim > 2 or B.ndim > 2
        self.shape = torch.Size((*lead, self.ldim, self.rdim))
        self.A = A.broadcast_to((*lead, self.ldim, self.mdim))  # views, no copies
        self.B = B.broadcast_to((*lead, self.mdim, self.rdim))
        self._svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ products
    def __matmul__(self, other: "torch.Tensor | FactoredMatrix") -> "torch.Tensor | FactoredMatrix":
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.ndim < 2:  # a vector [..., rdim]: M v, a tensor [..., ldim]
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        if other.shape[-2] != self.rdim:
            raise ValueError(f"FactoredMatrix @ tensor: the matrix is {tuple(self.shape)}, so the right side needs "
                             f"{self.rdim} rows; got {tuple(other.shape)}")
        # keep the smaller inner size: B @ other when B is the narrow end, else fold A B into the left factor
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: "torch.Tensor | FactoredMatrix") -> "torch.Tensor | FactoredMatrix":
        if isinstance(other, FactoredMatrix):
            return other.A @ (other.B @ self)
        if other.shape[-1] != self.ldim:
            raise ValueError(f"tensor @ FactoredMatrix: the matrix is {tuple(self.shape)}, so the left side needs "
                             f"{self.ldim} columns; got {tuple(other.shape)}")
        if other.ndim < 2:  # a vector [ldim]: v M, a tensor [..., rdim]
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: Scalar) -> "FactoredMatrix":
        """c M, with the scalar put into A. For a matrix product use `@`."""
        if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
            raise ValueError(f"FactoredMatrix * x needs a scalar; got a tensor of shape {tuple(scalar.shape)} "
                             "(use @ for a matrix product)")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    @property
    def AB(self) -> torch.Tensor:
        """The product [..., ldim, rdim] (formed: costs ldim x rdim memory per leading index)."""
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:
        """The reverse product [..., mdim, mdim]; defined only for a square M (ldim == rdim)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square FactoredMatrix (ldim == rdim); this one is {tuple(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        """M^T = B^T A^T, still factored."""
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B)."""
        return self.A, self.B

    # ------------------------------------------------------------ spectra
    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U [..., ldim, k], S [..., k], V [..., rdim, k]) with M = U diag(S) V^T and k = min(ldim, mdim, rdim),
        S descending. V, not V^T, is returned, as TransformerLens returns it. Computed once per FactoredMatrix.

        From the factors' own SVDs A = Ua Sa Va^T and B = Ub Sb Vb^T: M = Ua (Sa Va^T Ub Sb) Vb^T, so the SVD of the
        small core matrix gives M's, and nothing ldim x rdim is formed."""
        if self._svd is None:
            Ua, Sa, Vha = torch.linalg.svd(_wide(self.A), full_matrices=False)
            Ub, Sb, Vhb = torch.linalg.svd(_wide(self.B), full_matrices=False)
            core = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]  # [..., ka, kb]
            Uc, S, Vhc = torch.linalg.svd(core, full_matrices=False)
            self._svd = Ua @ Uc, S, (Vhc @ Vhb).transpose(-2, -1)
        return self._svd

    @property
    def U(self) -> torch.Tensor:
        """Left singular vectors [..., ldim, k]."""
        return self.svd()[0]

    @property
    def S(self) -> torch.Tensor:
        """Singular values [..., k], descending."""
        return self.svd()[1]

    @property
    def V(self) -> torch.Tensor:
        """Right singular vectors [..., rdim, k]: M = U diag(S) V^T."""
        return self.svd()[2]

    @property
    def Vh(self) -> torch.Tensor:
        """TransformerLens 3's name for `V` [..., rdim, k]: it returns V itself, not V^T (so M = U diag(S) Vh^T)."""
        return self.svd()[2]

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues [..., mdim] (complex) of a square M, read from BA [mdim, mdim]: AB and BA share their
        nonzero eigenvalues (BA v = k v gives AB (A v) = k (A v))."""
        return torch.linalg.eig(_wide(self.BA)).eigenvalues

    def norm(self) -> torch.Tensor:
        """Frobenius norm [...]: the root of the sum of the squared singular values."""
        return self.S.pow(2).sum(-1).sqrt()

    def make_even(self) -> "FactoredMatrix":
        """The same M as U sqrt(S) times sqrt(S) V^T: both factors carry half the spectrum, with orthogonal
        columns (of A) and rows (of B)."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def collapse_l(self) -> torch.Tensor:
        """M with its left orthogonal factor U dropped: diag(S) V^T [..., k, rdim]."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> torch.Tensor:
        """M with its right orthogonal factor V^T dropped: U diag(S) [..., ldim, k]."""
        return self.U * self.S[..., None, :]

    # ------------------------------------------------------------ shape
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def unsqueeze(self, k: int) -> "FactoredMatrix":
        """A new size-1 axis at `k` of both factors (k should index a leading dimension)."""
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """The first k entries along every axis of M (forming only M's top-left k x k block)."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(k) for _ in range(corner.ndim))]

    def __getitem__(self, idx: object) -> "FactoredMatrix":
        """Index leading dims, then rows, then columns, without forming M: `OV[layer, head]`, `M[..., :5, 2]`.
        An integer row or column index keeps its axis (size 1), so the result is still a matrix."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is None for i in idx):
            raise IndexError("FactoredMatrix indexing takes ints, slices, index tensors and ..., not None; "
                             "use .unsqueeze(k) for a new axis")
        if sum(i is Ellipsis for i in idx) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if Ellipsis in idx:
            at = idx.index(Ellipsis)
            idx = idx[:at] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[at + 1:]
        if len(idx) > self.ndim:
            raise IndexError(f"too many indices ({len(idx)}) for a FactoredMatrix of shape {tuple(self.shape)}")
        idx = idx + (slice(None),) * (self.ndim - len(idx))  # [*lead, rows, cols]
        lead, rows, cols = idx[:-2], _keep_axis(idx[-2]), _keep_axis(idx[-1])
        return FactoredMatrix(self.A[lead + (rows, slice(None))], self.B[lead + (slice(None), cols)])

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"


def _keep_axis(i: object) -> object:
    """An int row/column index as the one-long slice that selects it, so its axis stays."""
    if isinstance(i, bool) or not isinstance(i, numbers.Integral):
        return i
    i = int(i)
    return slice(i, i + 1 if i != -1 else None)
