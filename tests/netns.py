"""Two "hosts" on one machine for the multi-host tests: scripts/netem.py's emulated network with two namespaces on
a bridge, no rate limit (root needed; the tests skip otherwise)."""


from kparallax_bench import netem

NET = 77  # 10.78.77.0/24: the cluster files of the tests name these addresses
ADDRESSES = tuple(netem.Network(2, net=NET).address(i) for i in range(2))


class NetnsPair(netem.Network):
    """Namespaces ``names[i]`` holding ``ADDRESSES[i]``; this machine's host name resolves to that address inside
    each, as it would on a real host."""

    def __init__(self):
        super().__init__(2, net=NET)
