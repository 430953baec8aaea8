package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// netFlags are the network policy flags of `sandbox create` and `sandbox network`.
type netFlags struct {
	spec     string // a whole policy (JSON, @file or - for stdin)
	egress   bool
	allow    []string
	deny     []string
	headers  []string // DOMAIN:NAME=VALUE
	proxy    string   // socks5://[user[:password]@]host:port
	noProxy  bool
	noRules  bool
	withNet  bool // --network-closed on create
	hasFlags func(names ...string) bool
}

func (n *netFlags) register(f *pflag.FlagSet, create bool) {
	f.StringVar(&n.spec, "network", "", "the whole network policy as JSON (or @FILE, or - for stdin), docs/networking.md")
	f.BoolVar(&n.egress, "egress", false, "turn egress on (--egress=false turns it off, keeping the network namespace)")
	f.StringArrayVar(&n.allow, "allow-out", nil, "allow a CIDR, address, domain or *.domain (repeatable; allow wins over deny)")
	f.StringArrayVar(&n.deny, "deny-out", nil, "deny a CIDR, address, domain or *.domain (repeatable; 0.0.0.0/0 makes the allow list an allowlist)")
	f.StringArrayVar(&n.headers, "header", nil, "set a header on HTTPS requests to a domain: DOMAIN:NAME=VALUE (repeatable; the value never enters the sandbox)")
	f.StringVar(&n.proxy, "egress-proxy", "", "send egress through a SOCKS5 proxy: socks5://[USER[:PASSWORD]@]HOST:PORT (fails closed)")
	if create {
		f.BoolVar(&n.withNet, "network-closed", false, "give the sandbox a network namespace with egress off, so that its policy can be opened later")
	} else {
		f.BoolVar(&n.noProxy, "no-egress-proxy", false, "remove the SOCKS5 proxy")
		f.BoolVar(&n.noRules, "no-headers", false, "remove every header rule")
	}
	n.hasFlags = func(names ...string) bool {
		for _, name := range names {
			if f.Changed(name) {
				return true
			}
		}
		return false
	}
}

// readSpec reads --network's value: JSON, @FILE or - (stdin).
func (a *app) readSpec(v string) ([]byte, error) {
	switch {
	case v == "-":
		return io.ReadAll(io.LimitReader(a.env.Stdin, 1<<20))
	case strings.HasPrefix(v, "@"):
		return os.ReadFile(v[1:])
	default:
		return []byte(v), nil
	}
}

// patch returns the merge patch the flags ask for (nil when none was given).
func (a *app) netPatch(n *netFlags) (map[string]any, error) {
	p := map[string]any{}
	if n.spec != "" {
		b, err := a.readSpec(n.spec)
		if err != nil {
			return nil, fmt.Errorf("--network: %w", err)
		}
		if err := json.Unmarshal(b, &p); err != nil {
			return nil, fmt.Errorf("--network: not a JSON object: %w", err)
		}
	}
	if n.hasFlags("egress") {
		p["egress"] = n.egress
	}
	if n.hasFlags("allow-out") {
		p["allow_out"] = n.allow
	}
	if n.hasFlags("deny-out") {
		p["deny_out"] = n.deny
	}
	if len(n.headers) > 0 {
		rules := map[string]map[string]string{}
		for _, h := range n.headers {
			domain, kv, ok := strings.Cut(h, ":")
			name, val, ok2 := strings.Cut(kv, "=")
			if !ok || !ok2 || domain == "" || name == "" {
				return nil, fmt.Errorf("--header %q must look like DOMAIN:NAME=VALUE", h)
			}
			if rules[domain] == nil {
				rules[domain] = map[string]string{}
			}
			rules[domain][name] = val
		}
		out := map[string]any{}
		for d, hs := range rules {
			out[d] = []api.NetworkRule{{Transform: &api.NetworkTransform{Headers: hs}}}
		}
		p["rules"] = out
	}
	if n.noRules {
		p["rules"] = nil
	}
	if n.proxy != "" {
		ep, err := parseProxyURL(n.proxy)
		if err != nil {
			return nil, err
		}
		p["egress_proxy"] = ep
	}
	if n.noProxy {
		p["egress_proxy"] = nil
	}
	if len(p) == 0 {
		return nil, nil
	}
	return p, nil
}

// createNetwork is the policy of `sandbox create`'s flags (nil: none given).
func (a *app) createNetwork(n *netFlags) (*api.Network, error) {
	p, err := a.netPatch(n)
	if err != nil {
		return nil, err
	}
	if p == nil && !n.withNet {
		return nil, nil
	}
	if p == nil {
		p = map[string]any{}
	}
	// Asking for lists, rules or a proxy means egress, unless --egress=false says not.
	if _, set := p["egress"]; !set && !n.withNet && n.spec == "" {
		p["egress"] = true
	}
	b, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	var spec api.Network
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&spec); err != nil {
		return nil, fmt.Errorf("network policy: %w", err)
	}
	return &spec, nil
}

func parseProxyURL(s string) (*api.EgressProxy, error) {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "socks5" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return nil, fmt.Errorf("--egress-proxy %q must look like socks5://[USER[:PASSWORD]@]HOST:PORT", s)
	}
	ep := &api.EgressProxy{Address: u.Host}
	if u.User != nil {
		ep.Username = u.User.Username()
		ep.Password, _ = u.User.Password()
	}
	return ep, nil
}

func (a *app) networkCmd() *cobra.Command {
	var nf netFlags
	cmd := &cobra.Command{
		Use:   "network ID",
		Short: "Show or change a sandbox's network policy",
		Long: `Without flags, show the sandbox's network policy (secrets redacted), whether its
node has it in force, and its address. With flags, change the policy of the running
sandbox (no restart): the flags given replace those parts of the policy, the others
stay (a JSON merge patch; --network takes a patch too). The node applies the change
in one transaction, within a second, and cuts the connections it no longer allows. A
policy that cannot be applied leaves the previous one in force and the error says why.

Only a sandbox created with a network policy (even one with egress off:
--network-closed) has a network whose policy can change.`,
		Example: `  space sandbox network $id
  space sandbox network $id --egress --allow-out pypi.org --allow-out '*.pythonhosted.org' --deny-out 0.0.0.0/0
  space sandbox network $id --header 'api.example.com:Authorization=Bearer sk-…'
  space sandbox network $id --egress=false
  space sandbox network $id --network '{"deny_out": null}'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			p, err := a.netPatch(&nf)
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			var st *api.NetworkState
			if p == nil {
				st, err = c.GetNetwork(ctx, args[0])
			} else {
				st, err = c.PatchNetwork(ctx, args[0], p)
			}
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(st)
			}
			a.printNetwork(st)
			return nil
		},
	}
	nf.register(cmd.Flags(), false)
	return cmd
}

func (a *app) printNetwork(st *api.NetworkState) {
	w := a.env.Stdout
	n := st.Network
	applied := "no (applied when the sandbox next starts)"
	if st.Applied {
		applied = "yes"
	}
	fmt.Fprintf(w, "egress:       %v\n", onOff(n.Egress))
	if len(n.AllowOut) > 0 {
		fmt.Fprintf(w, "allow out:    %s\n", strings.Join(n.AllowOut, ", "))
	}
	if len(n.DenyOut) > 0 {
		fmt.Fprintf(w, "deny out:     %s\n", strings.Join(n.DenyOut, ", "))
	}
	for d, rules := range n.Rules {
		for _, r := range rules {
			if r.Transform == nil {
				continue
			}
			for h := range r.Transform.Headers {
				fmt.Fprintf(w, "header:       %s: %s (value hidden)\n", d, h)
			}
		}
	}
	if p := n.EgressProxy; p != nil {
		user := ""
		if p.Username != "" {
			user = p.Username + "@"
		}
		fmt.Fprintf(w, "egress proxy: socks5://%s%s\n", user, p.Address)
	}
	fmt.Fprintf(w, "in force:     %s\n", applied)
	if st.Address != "" {
		fmt.Fprintf(w, "address:      %s\n", st.Address)
	}
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func (a *app) netlogCmd() *cobra.Command {
	var follow bool
	var from int64
	cmd := &cobra.Command{
		Use:   "netlog ID",
		Short: "Print a sandbox's egress audit log",
		Long: `Print every DNS query and connection attempt of the sandbox, allowed or denied,
and the end of every allowed connection with its bytes. With -f, keep following
new entries (reconnecting where it left off). -o json prints one JSON object per
line.`,
		Example: `  space sandbox netlog $id
  space sandbox netlog $id -f -o json | jq 'select(.verdict == "denied")'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			w := a.env.Stdout
			enc := json.NewEncoder(w)
			return c.FollowNetLog(cmdContext(cmd), args[0], client.NetLogOptions{From: from, Follow: follow}, func(ev api.NetworkEvent, gap int64) error {
				if gap > 0 && !a.json() {
					fmt.Fprintf(w, "… %d entries dropped (the node's journal is bounded)\n", gap)
				}
				if a.json() {
					return enc.Encode(ev)
				}
				_, err := fmt.Fprintln(w, formatNetEvent(ev))
				return err
			})
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow new entries")
	cmd.Flags().Int64Var(&from, "from", 0, "start at this offset")
	return cmd
}

// formatNetEvent is one line of `sandbox netlog`.
func formatNetEvent(ev api.NetworkEvent) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %-7s %-7s %-5s %s", ev.Time.Local().Format("15:04:05.000"), ev.Verdict, ev.Kind, ev.Protocol, ev.Destination)
	if ev.Domain != "" {
		fmt.Fprintf(&b, " (%s)", ev.Domain)
	}
	if ev.Reason != "" {
		fmt.Fprintf(&b, " %s", ev.Reason)
	}
	if ev.Kind == api.NetEventClose {
		fmt.Fprintf(&b, " out=%d in=%d", ev.BytesOut, ev.BytesIn)
	}
	if ev.Count > 1 {
		fmt.Fprintf(&b, " ×%d", ev.Count)
	}
	return b.String()
}
