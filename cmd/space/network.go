package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/service"
)

// netConfig is space serve's network settings (docs/networking.md, "Operating").
type netConfig struct {
	mode          string // auto, on, off
	uplink        string
	allow         string // comma-separated CIDRs
	pool          string
	dnsUpstreams  string // comma-separated ip[:port]
	defaultEgress string // none, closed, open
	hostNetns     string // a namespace playing the host (tests)
	netnsDir      string
}

// enabled says whether sandbox networking is meant to run (--network on, or auto as
// root): what the E2B gateway tells SDKs.
func (c *netConfig) enabled() bool {
	return c.mode == "on" || (c.mode == "auto" && os.Geteuid() == 0)
}

// serviceNetwork is the api role's view of the network settings.
func (c *netConfig) serviceNetwork() (service.NetworkConfig, error) {
	var out service.NetworkConfig
	allow, err := parseCIDRs("--network-allow", c.allow)
	if err != nil {
		return out, err
	}
	out.AllowPrivate = allow
	if c.pool != "" {
		p, err := netip.ParsePrefix(c.pool)
		if err != nil || !p.Addr().Is4() || p.Masked() != p || p.Bits() > 29 {
			return out, fmt.Errorf("--network-pool %q: want an IPv4 network of /29 or larger, like 10.201.0.0/16", c.pool)
		}
		out.Pool = p
	}
	switch c.defaultEgress {
	case "", "none":
	case "closed":
		out.Default = &api.Network{}
	case "open":
		out.Default = &api.Network{Egress: true}
	default:
		return out, fmt.Errorf("--default-egress must be none, closed or open")
	}
	return out, nil
}

func parseCIDRs(flag, s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			a, aerr := netip.ParseAddr(f)
			if aerr != nil {
				return nil, fmt.Errorf("%s: %q is not a CIDR", flag, f)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if p.Masked() != p {
			return nil, fmt.Errorf("%s: %q has host bits set (did you mean %s?)", flag, f, p.Masked())
		}
		out = append(out, p)
	}
	return out, nil
}

// managerConfig is the node's network manager configuration for data dir dataDir.
// Names on the host (namespace pins, nftables tables, the nflog group) are derived
// from the data dir, so that several servers on one host (tests) never take each
// other's sandboxes for leftovers.
func (c *netConfig) managerConfig(dataDir string, log *slog.Logger) (network.Config, error) {
	sc, err := c.serviceNetwork()
	if err != nil {
		return network.Config{}, err
	}
	sum := sha256.Sum256([]byte(dataDir))
	cfg := network.Config{
		Logger:       log,
		HostNetns:    c.hostNetns,
		NetnsDir:     c.netnsDir,
		Prefix:       "s" + hex.EncodeToString(sum[:3]) + "-",
		Pool:         sc.Pool,
		Uplink:       c.uplink,
		AllowPrivate: sc.AllowPrivate,
		CADir:        filepath.Join(dataDir, "network", "ca"),
		NflogGroup:   uint16(1000 + binary.BigEndian.Uint16(sum[3:5])%30000),
	}
	for _, u := range strings.Split(c.dnsUpstreams, ",") {
		if u = strings.TrimSpace(u); u != "" {
			cfg.Upstreams = append(cfg.Upstreams, u)
		}
	}
	return cfg, nil
}

// startNetwork starts the node's network manager as --network says: off runs none
// (sandboxes with a network policy fail to start on this node), on fails the start
// when it cannot run, auto runs it when it can (root) and logs why not otherwise.
func (c *netConfig) startNetwork(ctx context.Context, dataDir string, log *slog.Logger) (*network.Manager, error) {
	switch c.mode {
	case "off":
		log.Info("sandbox networking off (--network off): sandboxes with a network policy cannot run on this node")
		return nil, nil
	case "auto", "on":
	default:
		return nil, fmt.Errorf("--network must be auto, on or off")
	}
	if c.mode == "auto" && os.Geteuid() != 0 {
		log.Warn("sandbox networking off: it needs root (--network auto)")
		return nil, nil
	}
	cfg, err := c.managerConfig(dataDir, log.With("component", "network"))
	if err != nil {
		return nil, err
	}
	m, err := network.New(ctx, cfg)
	if err != nil {
		if c.mode == "on" {
			return nil, fmt.Errorf("sandbox networking: %w", err)
		}
		log.Warn("sandbox networking off: it could not start (--network auto; --network on makes this fatal)", "err", err)
		return nil, nil
	}
	log.Info("sandbox networking on", "uplink", m.Uplink(), "netns", filepath.Join(cmpOr(cfg.NetnsDir, "/run/netns"), cfg.Prefix+"<id>"))
	return m, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
