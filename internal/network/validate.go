package network

import (
	"net/netip"

	"github.com/spacedev/space/api"
)

// DefaultPool is the sandbox address pool of a Config that names none.
var DefaultPool = netip.MustParsePrefix("10.201.0.0/16")

// Validate checks a network spec the way a node's Manager.Compile does, for callers
// without a Manager (the api role): against the always-denied ranges less the
// operator's exceptions allowPrivate, and the sandbox pool (zero: DefaultPool). The
// node checks again against its own host addresses when it applies the policy. Every
// error is fault.Invalid and names the field.
func Validate(spec *api.Network, allowPrivate []netip.Prefix, pool netip.Prefix) error {
	if !pool.IsValid() {
		pool = DefaultPool
	}
	_, err := Compile(spec, forbiddenSet(allowPrivate, pool))
	return err
}
