"""gridtrain's parallel library: the resolved layout (:class:`ParallelDims`), topology, communication,
layers, pipeline, ZeRO, planning.

Nothing in this package imports ``models`` or ``recipes``; process groups are
passed in, never read from module globals. Importing it starts nothing.
"""

from .dims import LayoutError, ParallelDims
from .topology import Coords, Topology, TopologyError

__all__ = ["Coords", "LayoutError", "ParallelDims", "Topology", "TopologyError"]
