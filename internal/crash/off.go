//go:build !failpoints

package crash

// Point marks a crash point. It does nothing outside failpoints builds.
func Point(string) {}
