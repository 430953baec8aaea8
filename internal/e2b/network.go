package e2b

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// E2B's network options (SandboxNetworkConfig on create, SandboxNetworkUpdateConfig on
// PUT /sandboxes/{id}/network) map onto space's network policy (docs/e2b.md,
// "Network"): egress through the node's per-sandbox rules, resolver and proxy, and the
// inbound options (allowPublicTraffic, maskRequestHost) onto the port routing of this
// gateway (ports.go).

// Reserved metadata of the inbound options (kept with the sandbox, copied to forks).
const (
	privateTrafficKey = metadataPrefix + "private-traffic"
	maskHostKey       = metadataPrefix + "mask-request-host"
)

// trafficTokenHeader carries a private sandbox's traffic access token on port requests.
const trafficTokenHeader = "E2b-Traffic-Access-Token"

// maxMaskHost bounds maskRequestHost.
const maxMaskHost = 253

// e2bNetwork is E2B's SandboxNetworkConfig, plus allow_internet_access of the update.
type e2bNetwork struct {
	AllowOut           []string                     `json:"allowOut,omitempty"`
	DenyOut            []string                     `json:"denyOut,omitempty"`
	AllowPublicTraffic *bool                        `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    *string                      `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int                        `json:"httpsPorts,omitempty"`
	Rules              map[string][]api.NetworkRule `json:"rules,omitempty"`
	EgressProxy        *api.EgressProxy             `json:"egressProxy,omitempty"`
	// AllowInternetAccess is only in the update body (snake case, as E2B has it).
	AllowInternetAccess *bool `json:"allow_internet_access,omitempty"`
}

// asksEgress reports whether n names any egress option.
func (n *e2bNetwork) asksEgress() bool {
	return n != nil && (n.AllowOut != nil || n.DenyOut != nil || n.Rules != nil || n.EgressProxy != nil)
}

// egressPolicy maps E2B's egress options onto a space policy: E2B's default is open
// egress; allow_internet_access false is "deny 0.0.0.0/0" with allowOut still allowed
// (allow wins over deny, in E2B as in space). On a server without sandbox networking,
// sandboxes have no network: the default and "no internet" are that, anything more
// is refused.
func (g *Gateway) egressPolicy(internet *bool, n *e2bNetwork) (*api.Network, error) {
	if !g.cfg.Network {
		if n.asksEgress() {
			return nil, fault.New(fault.Invalid, "network: sandbox networking is off on this server (space serve --network), so egress rules cannot apply")
		}
		return nil, nil
	}
	spec := &api.Network{Egress: true}
	if n != nil {
		spec.AllowOut = slices.Clone(n.AllowOut)
		spec.DenyOut = slices.Clone(n.DenyOut)
		spec.Rules = n.Rules
		spec.EgressProxy = n.EgressProxy
	}
	if internet != nil && !*internet && !slices.Contains(spec.DenyOut, "0.0.0.0/0") {
		spec.DenyOut = append(spec.DenyOut, "0.0.0.0/0")
	}
	return spec, nil
}

// inboundMetadata validates the inbound options and adds them to md (reserved keys).
func inboundMetadata(n *e2bNetwork, md map[string]string) (map[string]string, error) {
	if n == nil {
		return md, nil
	}
	if len(n.HTTPSPorts) > 0 {
		return nil, fault.New(fault.Invalid, "network.httpsPorts is not supported by space: sandbox ports are reached over plain HTTP")
	}
	private := n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic
	mask := ""
	if n.MaskRequestHost != nil {
		mask = *n.MaskRequestHost
		if err := validMask(mask); err != nil {
			return nil, err
		}
	}
	if !private && mask == "" {
		return md, nil
	}
	out := make(map[string]string, len(md)+2)
	for k, v := range md {
		out[k] = v
	}
	if private {
		out[privateTrafficKey] = "1"
	}
	if mask != "" {
		out[maskHostKey] = mask
	}
	return out, nil
}

// validMask checks maskRequestHost: a host (with an optional port) once ${PORT} is
// replaced.
func validMask(mask string) error {
	h := strings.ReplaceAll(mask, "${PORT}", "1")
	if mask == "" || len(mask) > maxMaskHost || strings.ContainsAny(h, " \t\r\n/\\@?#") {
		return fault.New(fault.Invalid, "network.maskRequestHost %q must be a host name, optionally with :port and ${PORT}", mask)
	}
	if host, port, err := net.SplitHostPort(h); err == nil {
		if _, err := strconv.ParseUint(port, 10, 16); err != nil || host == "" {
			return fault.New(fault.Invalid, "network.maskRequestHost %q: bad port", mask)
		}
	}
	return nil
}

// maskedHost is the Host a private-or-masked sandbox's server sees for port.
func maskedHost(sb *store.Sandbox, port int) string {
	m := sb.Metadata[maskHostKey]
	if m == "" {
		return ""
	}
	return strings.ReplaceAll(m, "${PORT}", strconv.Itoa(port))
}

// trafficToken is a private sandbox's traffic access token (derived, like the envd
// access token, from the sandbox id and the gateway's key: stable across pauses).
func (g *Gateway) trafficToken(id string) string {
	m := hmac.New(sha256.New, g.tokenKey)
	m.Write([]byte("traffic-access-token\x00" + id))
	return hex.EncodeToString(m.Sum(nil))
}

// trafficTokenOf is the token of the create, connect and resume answers (nil for public
// sandboxes).
func (g *Gateway) trafficTokenOf(sb *store.Sandbox) *string {
	if sb.Metadata[privateTrafficKey] == "" {
		return nil
	}
	t := g.trafficToken(sb.ID)
	return &t
}

// trafficAllowed checks a port request to a private sandbox for its traffic token.
func (g *Gateway) trafficAllowed(r *http.Request, sb *store.Sandbox) bool {
	if sb.Metadata[privateTrafficKey] == "" {
		return true
	}
	got := r.Header.Get(trafficTokenHeader)
	return subtle.ConstantTimeCompare([]byte(got), []byte(g.trafficToken(sb.ID))) == 1
}

// allowInternet is E2B's allowInternetAccess of a sandbox: egress on without a deny
// of everything.
func allowInternet(sb *store.Sandbox) bool {
	n := sb.Spec.Network
	if n == nil || !n.Egress {
		return false
	}
	return !slices.Contains(n.DenyOut, "0.0.0.0/0")
}

// e2bNetworkInfo is the network of GET /sandboxes/{id}: the egress options as stored
// (the proxy's password and header values are not shown) and the inbound ones.
type e2bNetworkInfo struct {
	AllowOut           []string                     `json:"allowOut,omitempty"`
	DenyOut            []string                     `json:"denyOut,omitempty"`
	Rules              map[string][]api.NetworkRule `json:"rules,omitempty"`
	EgressProxy        *api.EgressProxy             `json:"egressProxy,omitempty"`
	AllowPublicTraffic bool                         `json:"allowPublicTraffic"`
	MaskRequestHost    string                       `json:"maskRequestHost,omitempty"`
}

func networkInfo(sb *store.Sandbox) *e2bNetworkInfo {
	info := &e2bNetworkInfo{AllowPublicTraffic: sb.Metadata[privateTrafficKey] == "", MaskRequestHost: sb.Metadata[maskHostKey]}
	if n := sb.Spec.Network.Redacted(); n != nil {
		info.AllowOut, info.DenyOut, info.Rules, info.EgressProxy = n.AllowOut, n.DenyOut, n.Rules, n.EgressProxy
	}
	return info
}

// updateNetwork handles PUT /sandboxes/{id}/network (E2B's updateNetwork): the
// egress options replace the sandbox's whole policy, applied to the running sandbox
// at once.
func (g *Gateway) updateNetwork(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body e2bNetwork
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	sb, err := g.live(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if !g.cfg.Network {
		return fault.New(fault.Invalid, "network: sandbox networking is off on this server (space serve --network)")
	}
	spec, err := g.egressPolicy(body.AllowInternetAccess, &body)
	if err != nil {
		return err
	}
	raw, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	if _, err := g.api.UpdateNetwork(r.Context(), p, sb.ID, raw, false); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
