// Package token owns attachment tokens: short-lived bearer credentials for the data
// plane, scoped to one sandbox, one process and a set of rights, and carrying the
// sandbox's token epoch so that bumping the epoch (delete, suspend, revoke) kills every
// token issued before.
//
// Format: "spt1." + base64url(JSON claims) + "." + base64url(HMAC-SHA256(key, "spt1."+claims)).
// The version prefix pins the algorithm (no negotiation, no "none"); the MAC is checked
// in constant time before the claims are parsed. Both parts have exactly one accepted
// spelling: unpadded base64url with zero trailing bits and nothing else (no padding, no
// line breaks, no standard-alphabet characters), so a token cannot be re-spelled into
// another string that verifies. Tokens carry the id of the API key that minted them
// (the data plane refuses them once that key is revoked). The key lives in PostgreSQL so every
// replica verifies every token and tokens survive restarts.
package token

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/spacedev/space/internal/fault"
)

const prefix = "spt1."

// Rights a token can carry. RightNode is only minted by the api role for its own calls
// to a node's internal endpoints.
const (
	RightRead   = "read"
	RightStdin  = "stdin"
	RightResize = "resize"
	RightSignal = "signal"
	RightNode   = "node"
)

// Claims are what a token asserts.
type Claims struct {
	// Sandbox is the sandbox id the token is for.
	Sandbox string `json:"sb"`
	// PID is the process the token is for (0 for sandbox-wide node tokens), and Proc
	// that process's identity (wire.ProcessInfo.UID): a pid reused by another process
	// after the sandbox's instance was lost is not the token's process.
	PID  int    `json:"pid,omitempty"`
	Proc string `json:"proc,omitempty"`
	// Session is the command session id.
	Session string   `json:"sid,omitempty"`
	Rights  []string `json:"r"`
	Epoch   int64    `json:"ep"`
	// Expiry and IssuedAt are unix seconds.
	Expiry   int64 `json:"exp"`
	IssuedAt int64 `json:"iat"`
	// ID makes every token unique.
	ID string `json:"jti"`
	// Key is the id of the API key that minted the token ("" for node tokens, which
	// the api role mints for itself).
	Key string `json:"kid,omitempty"`
}

// Has reports whether the claims include right r.
func (c *Claims) Has(r string) bool { return slices.Contains(c.Rights, r) }

// ExpiresAt returns the expiry as a time.
func (c *Claims) ExpiresAt() time.Time { return time.Unix(c.Expiry, 0) }

// Signer mints and verifies tokens with one key.
type Signer struct {
	key []byte
	now func() time.Time
}

// NewSigner returns a signer for key (at least 32 bytes).
func NewSigner(key []byte) (*Signer, error) {
	if len(key) < 32 {
		return nil, errors.New("token: signing key shorter than 32 bytes")
	}
	return &Signer{key: key, now: time.Now}, nil
}

// Mint signs claims, filling IssuedAt and ID; ttl sets the expiry.
func (s *Signer) Mint(c Claims, ttl time.Duration) (string, Claims, error) {
	now := s.now()
	c.IssuedAt = now.Unix()
	c.Expiry = now.Add(ttl).Unix()
	id := make([]byte, 9)
	if _, err := rand.Read(id); err != nil {
		return "", c, err
	}
	c.ID = hex.EncodeToString(id)
	body, err := json.Marshal(c)
	if err != nil {
		return "", c, err
	}
	payload := prefix + base64.RawURLEncoding.EncodeToString(body)
	return payload + "." + base64.RawURLEncoding.EncodeToString(s.mac(payload)), c, nil
}

func (s *Signer) mac(payload string) []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(payload))
	return m.Sum(nil)
}

// Verify checks the token's MAC and expiry and returns its claims. It does not check
// scope or epoch: callers compare those with the request and the sandbox.
func (s *Signer) Verify(tok string) (*Claims, error) {
	if !strings.HasPrefix(tok, prefix) || len(tok) > 4096 {
		return nil, fault.New(fault.Unauthorized, "malformed token")
	}
	i := strings.LastIndexByte(tok, '.')
	if i <= len(prefix) {
		return nil, fault.New(fault.Unauthorized, "malformed token")
	}
	payload, sig := tok[:i], tok[i+1:]
	got, ok := decode(sig)
	if !ok || !hmac.Equal(got, s.mac(payload)) {
		return nil, fault.New(fault.Unauthorized, "invalid token signature")
	}
	body, ok := decode(payload[len(prefix):])
	if !ok {
		return nil, fault.New(fault.Unauthorized, "malformed token")
	}
	var c Claims
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, fault.New(fault.Unauthorized, "malformed token claims")
	}
	if s.now().Unix() >= c.Expiry {
		return nil, fault.New(fault.Unauthorized, "token expired")
	}
	return &c, nil
}

// decode decodes unpadded base64url and accepts only the canonical spelling: the one
// encoding the result gives back. (Go's decoder alone would also take line breaks
// anywhere and non-zero trailing bits.)
func decode(s string) ([]byte, bool) {
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil || base64.RawURLEncoding.EncodeToString(b) != s {
		return nil, false
	}
	return b, true
}

// Authorize checks that claims allow right on sandbox/pid at the sandbox's current
// epoch. pid 0 means a sandbox-wide request.
func Authorize(c *Claims, sandbox string, pid int, right string, epoch int64) error {
	if c.Sandbox != sandbox {
		return fault.New(fault.Forbidden, "token is not valid for this sandbox")
	}
	if c.Epoch != epoch {
		return fault.New(fault.Unauthorized, "token was revoked")
	}
	if c.Has(RightNode) {
		return nil
	}
	if c.PID != pid {
		return fault.New(fault.Forbidden, "token is not valid for this process")
	}
	if !c.Has(right) {
		return fault.New(fault.Forbidden, "token lacks the %q right", right)
	}
	return nil
}
