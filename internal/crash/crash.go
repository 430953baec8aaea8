// Package crash names the instants at which space is tested for crashes: every step of
// every lifecycle transition (and of pool fills and claims, template builds and base
// snapshots) calls Point with a stable name, like "suspend.checkpointed".
//
// In normal builds Point does nothing and costs nothing. Test builds made with
// `-tags failpoints` act on the points (failpoints.go): the crash walk in
// internal/crashtest runs each transition once recording the points it passes, then
// once per point with the process killed there (kill -9 semantics) or its PostgreSQL
// killed there, restarts, and checks that nothing was lost. This is the same idea as
// etcd's gofail, without a code generator: a build tag selects the implementation.
package crash
