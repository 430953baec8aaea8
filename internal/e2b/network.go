package e2b

import (
	"github.com/spacedev/space/internal/store"
)

// allowInternet is E2B's allowInternetAccess of a sandbox: egress on without a deny
// of everything.
func allowInternet(sb *store.Sandbox) bool {
	n := sb.Spec.Network
	if n == nil || !n.Egress {
		return false
	}
	for _, d := range n.DenyOut {
		if d == "0.0.0.0/0" {
			return false
		}
	}
	return true
}
