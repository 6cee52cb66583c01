"""The hand-over of target features to drafter ranks, apart from who computes them (targets/) and who trains on them
(drafters/, train/): samples addressed by key, delivered whole and checked, consumed once.

samples.py  the route-independent contract: keys with attempt numbers, a sample's parts and its manifest (shapes,
            dtypes, CRC32, written last), the ledger of consumed samples that a checkpoint keeps
mooncake.py Mooncake Store as the carrier (TCP on a CPU host, RDMA on a cluster): a master for local runs, the client
            with every return code turned into one line
processes.py the hand-over's child processes end with the rank that started them
"""
