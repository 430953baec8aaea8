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
