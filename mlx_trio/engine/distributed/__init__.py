"""Scale-out on mlx.distributed: one model over several processes (ranks), the actor tree only on rank 0.

Rank 0's GPU lease broadcasts every job to the followers, which run it in lockstep on their own
mirrors of the engine objects (docs/scale-out.md, docs/design.md §11): `world.py` (which rank this
process is; the tensor-parallel shard of a model), `mirror.py` (jobs as bytes: engine objects by
key), `frames.py` (bytes over the group's collectives), `leader.py` (rank 0's side of a job),
`follower.py` (a follower's whole life), `heartbeat.py` (each rank's state, one collective).
"""
