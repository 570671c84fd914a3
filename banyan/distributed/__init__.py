"""Beyond one process: tensor-parallel sharding (tensor_parallel.py, collectives.py; the worker processes are
runner/worker.py) and data-parallel replicas behind one API server with a router (router.py, replicas.py).
Importing this package loads no torch: the server imports the router."""
