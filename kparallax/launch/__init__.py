"""kparallax-run: starts PS tasks and Horovod workers and supervises them, on one host or many.

``cli`` parses the command line and picks a mode: ``local`` (every task on this host), ``multihost`` (per-host
mode: this host's tasks, coordinated with the other hosts' launchers) or ``ssh`` (a per-host launcher on every host,
started over ssh, or directly for hosts that are this machine). ``env`` builds the tasks' environment, ``tasks``
spawns, supervises and stops them, ``cluster_file`` reads cluster files. Nothing here imports TensorFlow, and
Horovod only for its rendezvous server when a run starts.
"""
