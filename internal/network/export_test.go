package network

// BreakNextApply makes the manager's next policy batch carry a rule the kernel
// refuses, so that tests can watch a refused batch leave the previous policy in force.
func BreakNextApply(m *Manager) { m.BreakNextApply() }

// Dump is dump, for tests.
func Dump[T any](list func() ([]T, error)) ([]T, error) { return dump(list) }

// DumpTries is dumpTries.
const DumpTries = dumpTries
