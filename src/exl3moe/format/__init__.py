"""The EXL3 format in pure torch: codebooks, tile rings, Hadamard, EXL3Weight, checkpoints."""

from .bitstream import (k_from_last_dim, matrix_to_tiles, pack_states, tile_permutation, tiles_to_matrix,
                        unpack_states)
from .codebook import CODEBOOKS, codebook_table, decode_states
from .hadamard import hadamard_blockwise, hadamard_matrix
from .weight import EXL3Weight, decode, unpack_signs

__all__ = ["CODEBOOKS", "EXL3Weight", "codebook_table", "decode", "decode_states", "hadamard_blockwise",
           "hadamard_matrix", "k_from_last_dim", "matrix_to_tiles", "pack_states", "tile_permutation",
           "tiles_to_matrix", "unpack_signs", "unpack_states"]
from .experts import ACTIVATIONS, ExpertSet, ResidualStage  # noqa: E402

__all__ += ["ACTIVATIONS", "ExpertSet", "ResidualStage"]
from .checkpoint import CheckpointReader, LinearInfo, open_checkpoint, write_checkpoint  # noqa: E402

__all__ += ["CheckpointReader", "LinearInfo", "open_checkpoint", "write_checkpoint"]
