//go:build !failpoints

package gvisor

// agentListensForTests is false outside test builds: every new instance's agent
// connects to the node (listen_failpoints.go).
func agentListensForTests() bool { return false }
