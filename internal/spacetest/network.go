package spacetest

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"strconv"
	"sync"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/node"
)

// FakeNetwork is a node.NetworkManager for rootless tests: it keeps each sandbox's
// policy, address and audit journal in memory, validates specs like the real manager,
// and sets up no namespace (the fake runtime's agents run on the host). Tests append
// audit events (Journal) and make the next policy change fail (FailNextUpdate), as the
// kernel refusing a batch would. Real networking is tested with root in
// internal/network and internal/e2e.
type FakeNetwork struct {
	mu       sync.Mutex
	sbs      map[string]*fakeNet
	next     uint32
	failNext error
	// Setups counts Setup calls per sandbox, Adopts Adopt calls.
	Setups, Adopts map[string]int
}

type fakeNet struct {
	spec *api.Network
	pol  *network.Policy
	addr netip.Addr
	jr   *network.Journal
}

var _ node.NetworkManager = (*FakeNetwork)(nil)

// NewFakeNetwork returns an empty fake.
func NewFakeNetwork() *FakeNetwork {
	return &FakeNetwork{sbs: map[string]*fakeNet{}, Setups: map[string]int{}, Adopts: map[string]int{}}
}

// Compile validates spec as a node with the default configuration would.
func (f *FakeNetwork) Compile(spec *api.Network) (*network.Policy, error) {
	if err := network.Validate(spec, nil, netip.Prefix{}); err != nil {
		return nil, err
	}
	return network.Compile(spec, nil)
}

func (f *FakeNetwork) setup(id string, spec *api.Network) (*network.Attachment, error) {
	pol, err := f.Compile(spec)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb := f.sbs[id]
	if sb == nil {
		f.next++
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], 10<<24|201<<16|f.next*4+2)
		sb = &fakeNet{addr: netip.AddrFrom4(b), jr: network.NewJournal(64)}
		f.sbs[id] = sb
	}
	sb.spec, sb.pol = spec, pol
	return f.attachment(id, sb), nil
}

func (f *FakeNetwork) attachment(id string, sb *fakeNet) *network.Attachment {
	return &network.Attachment{ID: id, Interface: "eth0", Address: netip.PrefixFrom(sb.addr, 30), Gateway: sb.addr.Prev()}
}

// Setup records the sandbox's policy.
func (f *FakeNetwork) Setup(_ context.Context, id string, spec *api.Network) (*network.Attachment, error) {
	f.mu.Lock()
	f.Setups[id]++
	f.mu.Unlock()
	return f.setup(id, spec)
}

// Adopt records the sandbox's policy (after a node restart).
func (f *FakeNetwork) Adopt(_ context.Context, id string, spec *api.Network) (*network.Attachment, error) {
	f.mu.Lock()
	f.Adopts[id]++
	f.mu.Unlock()
	return f.setup(id, spec)
}

// FailNextUpdate makes the next Update fail with err, leaving the policy as it is.
func (f *FakeNetwork) FailNextUpdate(err error) {
	f.mu.Lock()
	f.failNext = err
	f.mu.Unlock()
}

// Update replaces a set-up sandbox's policy.
func (f *FakeNetwork) Update(_ context.Context, id string, spec *api.Network) error {
	pol, err := f.Compile(spec)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb := f.sbs[id]
	if sb == nil {
		return fault.New(fault.NotFound, "network: sandbox %s has no network set up", id)
	}
	if err := f.failNext; err != nil {
		f.failNext = nil
		return err
	}
	sb.spec, sb.pol = spec, pol
	sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: "policy_changed", Protocol: "tcp"})
	return nil
}

func (f *FakeNetwork) get(id string) (*fakeNet, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb := f.sbs[id]
	if sb == nil {
		return nil, fault.New(fault.NotFound, "network: sandbox %s has no network set up", id)
	}
	return sb, nil
}

// Attachment returns a set-up sandbox's attachment.
func (f *FakeNetwork) Attachment(id string) (*network.Attachment, error) {
	sb, err := f.get(id)
	if err != nil {
		return nil, err
	}
	return f.attachment(id, sb), nil
}

// Policy returns the policy in force.
func (f *FakeNetwork) Policy(id string) (*network.Policy, error) {
	sb, err := f.get(id)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return sb.pol, nil
}

// Spec returns the spec in force for a sandbox (nil if it has no network set up).
func (f *FakeNetwork) Spec(id string) *api.Network {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb := f.sbs[id]; sb != nil {
		return sb.spec
	}
	return nil
}

// Teardown forgets the sandbox.
func (f *FakeNetwork) Teardown(_ context.Context, id string) error {
	f.mu.Lock()
	sb := f.sbs[id]
	delete(f.sbs, id)
	f.mu.Unlock()
	if sb != nil {
		sb.jr.Close()
	}
	return nil
}

// Reconcile forgets every sandbox keep rejects.
func (f *FakeNetwork) Reconcile(ctx context.Context, keep func(string) bool) ([]string, error) {
	f.mu.Lock()
	var drop []string
	for id := range f.sbs {
		if !keep(id) {
			drop = append(drop, id)
		}
	}
	f.mu.Unlock()
	for _, id := range drop {
		_ = f.Teardown(ctx, id)
	}
	return drop, nil
}

// Events returns a set-up sandbox's journal.
func (f *FakeNetwork) Events(id string) (*network.Journal, error) {
	sb, err := f.get(id)
	if err != nil {
		return nil, err
	}
	return sb.jr, nil
}

// Journal is Events for tests (nil when the sandbox has no network set up).
func (f *FakeNetwork) Journal(id string) *network.Journal {
	jr, _ := f.Events(id)
	return jr
}

// DialSandbox connects to port on the host (the fake runtime's sandboxes are host
// processes).
func (f *FakeNetwork) DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error) {
	if _, err := f.get(id); err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	if err != nil {
		return nil, fault.Wrap(fault.Unavailable, errors.Join(errors.New("dial sandbox"), err))
	}
	return c, nil
}
