"""KV cache handoff from the prefill worker to the decode worker's page pool (see docs/kvtransfer.md).

layout.KVLayout (geometry + stable hash), destination.Destination (the KVDestination message), shm_pool
(decode's pool in POSIX shared memory), shm_transport / shm_receiver (write in place + completion
records), grpc_transport / grpc_receiver / grpc_servicer (KVTransferService.Push), leases.LeaseTable,
mooncake_transport (optional RDMA), device_pool / device_transport (device pools over CUDA / HIP IPC,
or the memfd stand-in on the CPU).
"""
