"""Floor 0 of pdserve: the generated gRPC stubs (rpc.v1 public, rpc.internal.v1 between processes), the one
exception -> gRPC status mapper, server helpers, the engine thread and logging. Imports no other project
package and no torch."""
