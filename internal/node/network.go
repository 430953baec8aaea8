package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// NetworkManager is what the node needs of internal/network (*network.Manager): a
// network namespace, veth and egress policy per sandbox, set up before the runtime
// starts the sandbox and kept until it is deleted. An Attachment without Netns (test
// fakes) gives the runtime no namespace and the sandbox no configuration.
type NetworkManager interface {
	Setup(ctx context.Context, id string, spec *api.Network) (*network.Attachment, error)
	Adopt(ctx context.Context, id string, spec *api.Network) (*network.Attachment, error)
	Update(ctx context.Context, id string, spec *api.Network) error
	Compile(spec *api.Network) (*network.Policy, error)
	Attachment(id string) (*network.Attachment, error)
	Policy(id string) (*network.Policy, error)
	Teardown(ctx context.Context, id string) error
	Reconcile(ctx context.Context, keep func(id string) bool) ([]string, error)
	Events(id string) (*network.Journal, error)
	DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error)
}

var _ NetworkManager = (*network.Manager)(nil)

// Paths in the sandbox where the node installs the egress CA of header rules.
const (
	guestCACert   = "/usr/local/share/ca-certificates/space-egress.crt"
	guestCABundle = "/etc/ssl/certs/ca-certificates.crt"
	guestResolv   = "/etc/resolv.conf"
	// maxCABundle bounds the system bundle the node reads to extend it.
	maxCABundle = 4 << 20
)

// guestNetTimeout bounds the node's calls that configure a sandbox's network inside it.
const guestNetTimeout = 20 * time.Second

// netLocks serialises network changes per sandbox: a set-up before an instance starts,
// a policy change from the API, and the teardown.
type netLocks struct {
	mu sync.Mutex
	m  map[string]*sync.Mutex
}

func (l *netLocks) lock(id string) func() {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[string]*sync.Mutex{}
	}
	mu := l.m[id]
	if mu == nil {
		mu = &sync.Mutex{}
		l.m[id] = mu
	}
	l.mu.Unlock()
	mu.Lock()
	return mu.Unlock
}

func (l *netLocks) forget(id string) {
	l.mu.Lock()
	delete(l.m, id)
	l.mu.Unlock()
}

// errNoNetworking is the error of a networked sandbox on a node without networking.
func (n *Node) errNoNetworking() error {
	return fault.New(fault.Unavailable, "node %s has no networking (space serve runs it with --network; see docs/networking.md): sandboxes with a network policy cannot run here", n.cfg.Name)
}

// attachNetwork sets up (or finds again) the network of a sandbox before its instance
// starts or is restored, with the policy recorded now (a change that raced with this
// start is not lost). It returns nil for a sandbox without a network.
func (n *Node) attachNetwork(ctx context.Context, sb *store.Sandbox) (*network.Attachment, error) {
	if sb.Spec.Network == nil {
		return nil, nil
	}
	if n.net == nil {
		return nil, n.errNoNetworking()
	}
	unlock := n.netLocks.lock(sb.ID)
	defer unlock()
	if cur, err := n.st.GetSandbox(ctx, sb.ID); err == nil && cur.Spec.Network != nil {
		sb.Spec.Network = cur.Spec.Network
	}
	att, err := n.net.Setup(ctx, sb.ID, sb.Spec.Network)
	if err != nil {
		return nil, fmt.Errorf("set up the sandbox's network: %w", err)
	}
	return att, nil
}

// teardownNetwork removes whatever networking the sandbox has on this host.
func (n *Node) teardownNetwork(ctx context.Context, id string) error {
	if n.net == nil {
		return nil
	}
	unlock := n.netLocks.lock(id)
	err := n.net.Teardown(ctx, id)
	unlock()
	n.netLocks.forget(id)
	if err != nil {
		return fmt.Errorf("tear down network: %w", err)
	}
	return nil
}

// configureGuestNetwork points the sandbox's resolver at its node-side resolver and,
// when the policy has header rules, installs the egress CA in its trust store. It runs
// through the agent once the agent serves, before the sandbox is reported running.
func (n *Node) configureGuestNetwork(ctx context.Context, id string, att *network.Attachment) error {
	if att == nil || att.Netns == "" || n.info.Caps.Network == "" {
		// No namespace (a test's fake manager), or a runtime that does not put the
		// sandbox on it (the fake runtime, whose agents are host processes: a file
		// written "in the sandbox" would land on the host).
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, guestNetTimeout)
	defer cancel()
	a := n.agent(id)
	if n.info.Caps.Network == runtime.NetworkTap {
		// A VM: its NIC on the namespace's tap needs an address and a route (the same
		// in every VM: the namespace masquerades them, network.OpenTap).
		code, err := n.runCheck(ctx, id, wire.ProcessSpec{Argv: network.TapGuestConfig(), TimeoutMs: 10000})
		if err != nil {
			return fmt.Errorf("configure the VM's network: %w", err)
		}
		if code != 0 {
			return fmt.Errorf("configure the VM's network: ip exited %d (the template needs iproute2's ip and a virtio-net NIC)", code)
		}
	}
	if _, err := a.WriteFile(ctx, guestResolv, strings.NewReader(att.ResolvConf()), agentclient.WriteOptions{Mode: 0o644}); err != nil {
		return fmt.Errorf("write %s in the sandbox: %w", guestResolv, err)
	}
	if len(att.CACertPEM) > 0 {
		if err := installCA(ctx, a, att.CACertPEM); err != nil {
			return fmt.Errorf("install the egress CA in the sandbox: %w", err)
		}
	}
	return nil
}

// installCA puts the node's egress CA into the sandbox's trust store: its own file
// (which update-ca-certificates picks up should the sandbox run it) and the system
// bundle that OpenSSL, curl and most runtimes read. Repeating it changes nothing.
func installCA(ctx context.Context, a *agentclient.Client, pem []byte) error {
	if _, err := a.WriteFile(ctx, guestCACert, bytes.NewReader(pem), agentclient.WriteOptions{Mode: 0o644}); err != nil {
		return err
	}
	rc, _, err := a.ReadFile(ctx, guestCABundle, agentclient.ReadOptions{})
	var bundle []byte
	switch {
	case err == nil:
		bundle, err = io.ReadAll(io.LimitReader(rc, maxCABundle))
		rc.Close()
		if err != nil {
			return err
		}
	case fault.Is(err, fault.NotFound):
	default:
		return err
	}
	if bytes.Contains(bundle, bytes.TrimSpace(pem)) {
		return nil
	}
	if len(bundle) > 0 && bundle[len(bundle)-1] != '\n' {
		bundle = append(bundle, '\n')
	}
	bundle = append(bundle, pem...)
	_, err = a.WriteFile(ctx, guestCABundle, bytes.NewReader(bundle), agentclient.WriteOptions{Mode: 0o644})
	return err
}

// networkEnv adds what programs in a sandbox with header rules need to trust the
// egress CA (Node.js reads no system store).
func networkEnv(sb *store.Sandbox, env map[string]string) {
	if sb.Spec.Network != nil && len(sb.Spec.Network.Rules) > 0 {
		if _, ok := env["NODE_EXTRA_CA_CERTS"]; !ok {
			env["NODE_EXTRA_CA_CERTS"] = guestCACert
		}
	}
}

// recoverNetworks runs at start: every sandbox of this node with a network gets its
// networking back (resolver, proxy and rules: Setup adopts what exists), and the
// networking of sandboxes that no longer exist is torn down.
func (n *Node) recoverNetworks(ctx context.Context, list []*store.Sandbox) {
	if n.net == nil {
		return
	}
	keep := map[string]bool{}
	for _, sb := range list {
		if sb.Spec.Network == nil || sb.DeletedAt != nil {
			continue
		}
		switch sb.State {
		case api.StatePending, api.StateFailed, api.StateDeleted:
			continue
		}
		keep[sb.ID] = true
		// Adopt, not Setup: a running gVisor sandbox owns its interface. Every
		// start or restore sets the network up for itself (attachNetwork).
		unlock := n.netLocks.lock(sb.ID)
		_, err := n.net.Adopt(ctx, sb.ID, sb.Spec.Network)
		unlock()
		if err != nil {
			n.log.Warn("could not restore the sandbox's network; its next start sets it up again", "sandbox", sb.ID, "err", err)
		}
	}
	removed, err := n.net.Reconcile(ctx, func(id string) bool { return keep[id] })
	for _, id := range removed {
		n.log.Info("removed leftover sandbox network", "sandbox", id)
	}
	if err != nil {
		n.log.Warn("remove leftover sandbox networks", "err", err)
	}
}

// NetworkState describes a sandbox's network as the node has it.
func (n *Node) networkState(id string, spec *api.Network) api.NetworkState {
	st := api.NetworkState{}
	if r := spec.Redacted(); r != nil {
		st.Network = *r
	}
	if n.net == nil {
		return st
	}
	if att, err := n.net.Attachment(id); err == nil {
		st.Applied = true
		st.Address = att.Address.Addr().String()
		if p, err := n.net.Policy(id); err == nil {
			st.Policy = p.String()
		}
	}
	return st
}

// ApplyNetwork puts a new network policy in force for a sandbox of this node and
// records it. The change is one nftables transaction (connections the new policy
// denies are cut); if it cannot be applied, or cannot be recorded, the previous policy
// stays in force and the error says why. A sandbox whose network is not set up now
// (it is being created, or this node restarted and has not restored it) only has the
// policy recorded: its next start applies it.
func (n *Node) ApplyNetwork(ctx context.Context, id string, spec *api.Network) (api.NetworkState, error) {
	if spec == nil {
		return api.NetworkState{}, fault.New(fault.Invalid, "network: a policy is required (egress false turns egress off)")
	}
	if n.net == nil {
		return api.NetworkState{}, n.errNoNetworking()
	}
	unlock := n.netLocks.lock(id)
	defer unlock()
	sb, err := n.st.GetSandbox(ctx, id)
	if err != nil {
		return api.NetworkState{}, err
	}
	if sb.NodeID != n.cfg.ID || sb.DeletedAt != nil {
		return api.NetworkState{}, fault.New(fault.NotFound, "sandbox %s is not on this node", id)
	}
	if sb.Spec.Network == nil {
		return api.NetworkState{}, errNotNetworked(id)
	}
	if _, err := n.net.Compile(spec); err != nil {
		return api.NetworkState{}, err
	}
	old := sb.Spec.Network
	if _, err := n.net.Attachment(id); err != nil {
		if err := n.st.SetSandboxNetwork(ctx, id, spec); err != nil {
			return api.NetworkState{}, err
		}
		n.log.Info("network policy recorded; applied at the sandbox's next start", "sandbox", id)
		return n.networkState(id, spec), nil
	}
	start := time.Now()
	if err := n.net.Update(ctx, id, spec); err != nil {
		if fault.KindOf(err) == fault.Internal {
			err = fault.Wrap(fault.Unprocessable, fmt.Errorf("the policy could not be applied; the previous policy is still in force: %w", err))
		}
		return api.NetworkState{}, err
	}
	if err := n.st.SetSandboxNetwork(context.WithoutCancel(ctx), id, spec); err != nil {
		// In force but not recorded: a restart would bring the old one back. Put the
		// old one back now so that what is recorded is what holds.
		if rerr := n.net.Update(context.WithoutCancel(ctx), id, old); rerr != nil {
			n.log.Error("could not put the previous network policy back", "sandbox", id, "err", rerr)
			return api.NetworkState{}, errors.Join(fmt.Errorf("record the network policy: %w", err), rerr)
		}
		return api.NetworkState{}, fmt.Errorf("record the network policy (the previous policy is still in force): %w", err)
	}
	n.log.Info("network policy changed", "sandbox", id, "took", time.Since(start).Round(time.Millisecond))
	if len(spec.Rules) > 0 && (old == nil || len(old.Rules) == 0) {
		// New header rules: the sandbox must trust the egress CA. A suspended or
		// stopped sandbox gets it when it next runs (configureGuestNetwork).
		if att, err := n.net.Attachment(id); err == nil && len(att.CACertPEM) > 0 && n.isReady(id) {
			cctx, cancel := context.WithTimeout(ctx, guestNetTimeout)
			if err := installCA(cctx, n.agent(id), att.CACertPEM); err != nil {
				n.log.Warn("install the egress CA in the sandbox", "sandbox", id, "err", err)
			}
			cancel()
		}
	}
	return n.networkState(id, spec), nil
}

// errNotNetworked is the answer to a policy change for a sandbox created without one.
func errNotNetworked(id string) error {
	return fault.New(fault.Conflict, "sandbox %s was created without a network (no network namespace): create it with a network policy to change it later (egress false or deny_out [\"0.0.0.0/0\"] start closed)", id)
}

// NetworkStateOf returns the network of a sandbox of this node.
func (n *Node) NetworkStateOf(ctx context.Context, id string) (api.NetworkState, error) {
	sb, err := n.st.GetSandbox(ctx, id)
	if err != nil {
		return api.NetworkState{}, err
	}
	return n.networkState(id, sb.Spec.Network), nil
}

func (n *Node) isReady(id string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ready[id]
}
