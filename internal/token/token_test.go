package token

import (
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/fault"
)

func TestTokens(t *testing.T) {
	key := []byte(strings.Repeat("k", 32))
	s, err := NewSigner(key)
	if err != nil {
		t.Fatal(err)
	}
	tok, claims, err := s.Mint(Claims{Sandbox: "sba", PID: 7, Rights: []string{RightRead, RightStdin}, Epoch: 3}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if claims.ID == "" || claims.Expiry <= claims.IssuedAt {
		t.Fatalf("claims %+v", claims)
	}
	c, err := s.Verify(tok)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := NewSigner([]byte(strings.Repeat("x", 32)))
	expired := &Signer{key: key, now: func() time.Time { return time.Now().Add(2 * time.Minute) }}
	tampered := strings.Replace(tok, tok[10:14], "AAAA", 1)

	for _, tc := range []struct {
		name string
		err  func() error
		kind fault.Kind
	}{
		{"valid", func() error { return Authorize(c, "sba", 7, RightRead, 3) }, -1},
		{"other pid", func() error { return Authorize(c, "sba", 8, RightRead, 3) }, fault.Forbidden},
		{"other sandbox", func() error { return Authorize(c, "sbb", 7, RightRead, 3) }, fault.Forbidden},
		{"missing right", func() error { return Authorize(c, "sba", 7, RightSignal, 3) }, fault.Forbidden},
		{"revoked epoch", func() error { return Authorize(c, "sba", 7, RightRead, 4) }, fault.Unauthorized},
		{"expired", func() error { _, err := expired.Verify(tok); return err }, fault.Unauthorized},
		{"tampered", func() error { _, err := s.Verify(tampered); return err }, fault.Unauthorized},
		{"other key", func() error { _, err := other.Verify(tok); return err }, fault.Unauthorized},
		{"garbage", func() error { _, err := s.Verify("spt1.x"); return err }, fault.Unauthorized},
		{"no prefix", func() error { _, err := s.Verify(strings.TrimPrefix(tok, "spt1.")); return err }, fault.Unauthorized},
	} {
		err := tc.err()
		if tc.kind == -1 {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if err == nil || fault.KindOf(err) != tc.kind {
			t.Errorf("%s: got %v, want kind %v", tc.name, err, tc.kind)
		}
	}
	if _, err := NewSigner([]byte("short")); err == nil {
		t.Error("short key accepted")
	}
}

// TestOneSpelling checks that a token has exactly one accepted encoding: every other
// spelling of the same bytes (padding, line breaks, other trailing bits, the standard
// alphabet) is refused, in the signature and in the claims.
func TestOneSpelling(t *testing.T) {
	s, err := NewSigner([]byte(strings.Repeat("k", 32)))
	if err != nil {
		t.Fatal(err)
	}
	var tok string
	// A signature whose last character carries spare bits and claims with a '-' or '_'
	// (so a standard-alphabet spelling exists): mint until both hold.
	for i := 0; ; i++ {
		tok, _, err = s.Mint(Claims{Sandbox: "sba", Session: strings.Repeat("x", i%3) + "~~~~", PID: 7, Rights: []string{RightRead}, Epoch: 3, Key: "key_abc"}, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		body := tok[len(prefix):strings.LastIndexByte(tok, '.')]
		if strings.ContainsAny(body, "-_") {
			break
		}
		if i > 1000 {
			t.Fatal("no token with '-' or '_' in its claims")
		}
	}
	c, err := s.Verify(tok)
	if err != nil || c.Key != "key_abc" {
		t.Fatalf("valid token: %+v %v", c, err)
	}
	i := strings.LastIndexByte(tok, '.')
	payload, sig := tok[:i], tok[i+1:]
	// 32 MAC bytes are 43 characters with 2 spare bits in the last one: flipping them
	// decodes (leniently) to the same bytes.
	last := strings.IndexByte(alphabet, sig[len(sig)-1])
	otherBits := sig[:len(sig)-1] + string(alphabet[last^1])
	std := strings.NewReplacer("-", "+", "_", "/")
	for name, bad := range map[string]string{
		"padded signature":          tok + "=",
		"line break in signature":   payload + "." + sig[:10] + "\n" + sig[10:],
		"CR in claims":              payload[:8] + "\r" + payload[8:] + "." + sig,
		"other trailing bits":       payload + "." + otherBits,
		"standard alphabet claims":  prefix + std.Replace(payload[len(prefix):]) + "." + sig,
		"padded claims":             payload + "==" + "." + sig,
		"space after the signature": tok + " ",
	} {
		if bad == tok {
			t.Fatalf("%s: no change", name)
		}
		if _, err := s.Verify(bad); !fault.Is(err, fault.Unauthorized) {
			t.Errorf("%s: accepted (%v)", name, err)
		}
	}
}

const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
