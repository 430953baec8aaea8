package service

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// NetworkConfig is what the api role knows of the operator's network settings: the
// policy of sandboxes that ask for none, and what specs are valid (the nodes check
// again against their own hosts when they apply them).
type NetworkConfig struct {
	// Default is the policy of a sandbox whose create request has no network; nil
	// means no network at all (the default).
	Default *api.Network
	// AllowPrivate are the operator's exceptions to the always-denied ranges
	// (network.Config.AllowPrivate).
	AllowPrivate []netip.Prefix
	// Pool is the nodes' sandbox address pool (zero: network.DefaultPool).
	Pool netip.Prefix
}

// maxNetworkBody bounds a policy change's body.
const maxNetworkBody = 256 << 10

// ValidateNetwork checks a network spec against the operator's configuration. Every
// error is fault.Invalid and names the field ("network.allow_out[2]: …").
func (s *Service) ValidateNetwork(spec *api.Network) error {
	return network.Validate(spec, s.cfg.Network.AllowPrivate, s.cfg.Network.Pool)
}

// networkForCreate returns the network policy of a new sandbox: the request's, else
// the operator's default, validated. A policy (even with egress off) gives the
// sandbox a network namespace whose policy can change later; none means no network.
func (s *Service) networkForCreate(req *api.Network) (*api.Network, error) {
	spec := req
	if spec == nil {
		spec = s.cfg.Network.Default
	}
	if spec == nil {
		return nil, nil
	}
	spec = cloneNetwork(spec)
	if err := s.ValidateNetwork(spec); err != nil {
		return nil, err
	}
	return spec, nil
}

// cloneNetwork deep-copies a spec (through JSON: it is plain data).
func cloneNetwork(n *api.Network) *api.Network {
	if n == nil {
		return nil
	}
	b, _ := json.Marshal(n)
	var out api.Network
	_ = json.Unmarshal(b, &out)
	return &out
}

// Network returns a sandbox's network: its policy (secrets redacted) and whether its
// node has it in force.
func (s *Service) Network(ctx context.Context, p *Principal, id string) (api.NetworkState, error) {
	sb, err := s.sandbox(ctx, p, id)
	if err != nil {
		return api.NetworkState{}, err
	}
	if sb.DeletedAt != nil {
		return api.NetworkState{}, notFound(id)
	}
	stored := storedState(sb)
	if sb.Spec.Network == nil || sb.NodeID == "" {
		return stored, nil
	}
	var st api.NetworkState
	if err := s.nodeJSON(ctx, sb, http.MethodGet, "network", nil, nil, &st); err != nil {
		// The node is down or restarting: say what is recorded.
		s.log.Debug("network state from node", "sandbox", id, "err", err)
		return stored, nil
	}
	return st, nil
}

func storedState(sb *store.Sandbox) api.NetworkState {
	var st api.NetworkState
	if r := sb.Spec.Network.Redacted(); r != nil {
		st.Network = *r
	}
	return st
}

// UpdateNetwork changes a sandbox's network policy. body is a JSON merge patch (RFC
// 7386) of the current policy when merge is set (absent fields stay, null removes),
// else the whole new policy. The sandbox's node puts it in force at once (connections
// it no longer allows are cut) and records it; a policy that cannot be applied leaves
// the previous one in force and the error says why. A sandbox that is not on a node
// yet gets the policy when it is created.
func (s *Service) UpdateNetwork(ctx context.Context, p *Principal, id string, body []byte, merge bool) (api.NetworkState, error) {
	sb, err := s.sandbox(ctx, p, id)
	if err != nil {
		return api.NetworkState{}, err
	}
	if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
		return api.NetworkState{}, notFound(id)
	}
	if len(body) > maxNetworkBody {
		return api.NetworkState{}, fault.New(fault.TooLarge, "network policy exceeds %d bytes", maxNetworkBody)
	}
	var next *api.Network
	if merge {
		next, err = mergeNetwork(sb.Spec.Network, body)
	} else {
		next, err = decodeNetwork(body)
	}
	if err != nil {
		return api.NetworkState{}, err
	}
	if err := s.ValidateNetwork(next); err != nil {
		return api.NetworkState{}, err
	}
	if sb.NodeID == "" {
		err := s.st.SetUnplacedSandboxNetwork(ctx, sb.ID, next)
		if err == nil {
			s.log.Info("network policy recorded for a sandbox not placed yet", "sandbox", sb.ID)
			return api.NetworkState{Network: *next.Redacted()}, nil
		}
		if !errors.Is(err, store.ErrPlaced) {
			return api.NetworkState{}, err
		}
		if sb, err = s.st.GetSandbox(ctx, sb.ID); err != nil {
			return api.NetworkState{}, err
		}
	}
	if sb.Spec.Network == nil {
		return api.NetworkState{}, fault.New(fault.Conflict, "sandbox %s was created without a network (no network namespace): create it with a network policy to change it later (egress false or deny_out [\"0.0.0.0/0\"] start closed)", sb.ID)
	}
	var st api.NetworkState
	if err := s.nodeJSON(ctx, sb, http.MethodPut, "network", nil, next, &st); err != nil {
		return api.NetworkState{}, err
	}
	s.log.Info("network policy changed", "sandbox", sb.ID, "applied", st.Applied)
	return st, nil
}

// decodeNetwork decodes a whole policy strictly.
func decodeNetwork(body []byte) (*api.Network, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	var n api.Network
	if err := dec.Decode(&n); err != nil {
		return nil, networkJSONError(err)
	}
	if dec.More() {
		return nil, fault.New(fault.Invalid, "network: data after the JSON object")
	}
	return &n, nil
}

// mergeNetwork applies a JSON merge patch (RFC 7386) to the current policy.
func mergeNetwork(cur *api.Network, patch []byte) (*api.Network, error) {
	var p any
	if err := json.Unmarshal(patch, &p); err != nil {
		return nil, networkJSONError(err)
	}
	if _, ok := p.(map[string]any); !ok {
		return nil, fault.New(fault.Invalid, "network: the patch must be a JSON object")
	}
	var target any = map[string]any{}
	if cur != nil {
		b, err := json.Marshal(cur)
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(b, &target); err != nil {
			return nil, err
		}
	}
	merged, err := json.Marshal(mergePatch(target, p))
	if err != nil {
		return nil, err
	}
	return decodeNetwork(merged)
}

// mergePatch is RFC 7386's MergePatch: objects merge recursively, null removes a
// member, anything else replaces the target.
func mergePatch(target, patch any) any {
	pm, ok := patch.(map[string]any)
	if !ok {
		return patch
	}
	tm, ok := target.(map[string]any)
	if !ok {
		tm = map[string]any{}
	}
	for k, v := range pm {
		if v == nil {
			delete(tm, k)
			continue
		}
		tm[k] = mergePatch(tm[k], v)
	}
	return tm
}

func networkJSONError(err error) error {
	var te *json.UnmarshalTypeError
	switch {
	case strings.HasPrefix(err.Error(), "json: unknown field"):
		return fault.New(fault.Invalid, "network: %s", strings.TrimPrefix(err.Error(), "json: "))
	case errors.As(err, &te):
		return fault.New(fault.Invalid, "network.%s must be %s, not %s", te.Field, te.Type, te.Value)
	default:
		return fault.New(fault.Invalid, "network: malformed JSON: %v", err)
	}
}

// NetLog opens a sandbox's egress audit log on its node: an SSE stream of "network"
// events from offset from (ids are the offsets to resume from), following new ones
// unless follow is false. The caller closes it.
func (s *Service) NetLog(ctx context.Context, p *Principal, id string, from int64, follow bool) (io.ReadCloser, error) {
	sb, err := s.Sandbox(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if sb.DeletedAt != nil {
		return nil, notFound(id)
	}
	if sb.Spec.Network == nil {
		return nil, fault.New(fault.Conflict, "sandbox %s has no network, so no network log", id)
	}
	if sb.NodeID == "" {
		return nil, fault.New(fault.Conflict, "sandbox %s is not on a node yet", id)
	}
	q := url.Values{"from": {strconv.FormatInt(from, 10)}}
	if !follow {
		q.Set("follow", "0")
	}
	resp, err := s.nodeDo(ctx, sb, http.MethodGet, "netlog", q, nil)
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// nodeDo calls one of the internal network endpoints of the sandbox's node
// (/internal/v1/sandboxes/{id}/{what}) with a node token. A non-2xx answer is turned
// back into the error the node reported.
func (s *Service) nodeDo(ctx context.Context, sb *store.Sandbox, method, what string, q url.Values, body any) (*http.Response, error) {
	node, err := s.st.GetNode(ctx, sb.NodeID)
	if err != nil {
		return nil, err
	}
	tok, _, err := s.cfg.Signer.Mint(token.Claims{Sandbox: sb.ID, Rights: []string{token.RightNode}, Epoch: sb.TokenEpoch}, nodeTokenTTL)
	if err != nil {
		return nil, err
	}
	u := node.DataPlaneURL + "/internal/v1/sandboxes/" + sb.ID + "/" + what
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := s.cfg.NodeClient.Do(req)
	if err != nil {
		return nil, fault.Wrap(fault.Unavailable, fmt.Errorf("node %s unreachable: %w", node.Name, err))
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	var e api.Error
	_ = json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&e)
	msg := e.Error.Message
	if msg == "" {
		msg = fmt.Sprintf("node %s answered %s", node.Name, resp.Status)
	}
	return nil, fault.New(kindOfStatus(resp.StatusCode), "%s", msg)
}

// nodeJSON is nodeDo with a JSON answer.
func (s *Service) nodeJSON(ctx context.Context, sb *store.Sandbox, method, what string, q url.Values, body, out any) error {
	resp, err := s.nodeDo(ctx, sb, method, what, q, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(out); err != nil {
		return fault.Wrap(fault.BadGateway, fmt.Errorf("node's answer: %w", err))
	}
	return nil
}

// kindOfStatus maps a node's HTTP status back to the error kind it reported.
func kindOfStatus(status int) fault.Kind {
	switch status {
	case http.StatusBadRequest:
		return fault.Invalid
	case http.StatusNotFound:
		return fault.NotFound
	case http.StatusConflict:
		return fault.Conflict
	case http.StatusUnprocessableEntity:
		return fault.Unprocessable
	case http.StatusServiceUnavailable:
		return fault.Unavailable
	case http.StatusGatewayTimeout:
		return fault.Timeout
	case http.StatusTooManyRequests:
		return fault.TooManyRequests
	case http.StatusRequestEntityTooLarge:
		return fault.TooLarge
	default:
		return fault.BadGateway
	}
}
