"""The cluster runtime: who is a PS or a worker (``spec``), joining it from a worker (``runtime``), the job's
coordinator (``coordinator``: Horovod's rendezvous plus a small key-value store), network probes (``net``) and the
PS task's entry point (``ps_server``). ``spec``, ``net`` and ``coordinator`` never import TensorFlow or Horovod at
module level (the launcher uses them)."""

from kparallax.cluster.spec import Cluster

__all__ = ["Cluster"]
