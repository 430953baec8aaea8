//go:build failpoints

package gvisor

import "os"

// agentListensEnv, set to 1 in the environment of a failpoints build (a test build,
// internal/crash), starts new instances as before 2026-12-06: the agent listens and
// runsc runs with --host-uds=create. The end-to-end suite uses it to reach what the
// instances from then still do (a suspend refused for a unix socket bound on the
// disk) through the whole server; the package's own tests set Runtime.agentListens.
const agentListensEnv = "SPACE_TEST_GVISOR_AGENT_LISTENS"

func agentListensForTests() bool { return os.Getenv(agentListensEnv) == "1" }
