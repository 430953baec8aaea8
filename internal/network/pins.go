package network

import (
	"net/netip"
	"sort"
	"time"
)

// pinTable is the Go side of a sandbox's pinned addresses: which names each address
// was answered for, until when, and whether HTTPS to it goes through the header proxy.
// The kernel sets ("pin", "intercept") hold the same addresses with the same expiry, so
// a pin lapses in the kernel even when space is down.
type pinTable struct {
	max    int
	byAddr map[netip.Addr]*pin
}

type pin struct {
	names     map[string]bool
	expires   time.Time
	intercept bool
}

func newPinTable(max int) *pinTable {
	return &pinTable{max: max, byAddr: map[netip.Addr]*pin{}}
}

// lookup returns the names a live pin of a holds (sorted), or nil.
func (t *pinTable) lookup(a netip.Addr, now time.Time) []string {
	p := t.byAddr[a]
	if p == nil || !now.Before(p.expires) {
		return nil
	}
	out := make([]string, 0, len(p.names))
	for n := range p.names {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// prune drops expired pins.
func (t *pinTable) prune(now time.Time) {
	for a, p := range t.byAddr {
		if !now.Before(p.expires) {
			delete(t.byAddr, a)
		}
	}
}

// plan computes the kernel update for pinning addrs for name until expires: the
// elements to add, and of those the ones the kernel already holds (to delete first, so
// that their timeout is refreshed on kernels that ignore a re-add). ok is false when
// the table is full.
func (t *pinTable) plan(name string, addrs []netip.Addr, expires time.Time, intercept bool, now time.Time) (add []pinElem, present []pinElem, ok bool) {
	t.prune(now)
	fresh := 0
	for _, a := range addrs {
		if t.byAddr[a] == nil {
			fresh++
		}
	}
	if len(t.byAddr)+fresh > t.max {
		return nil, nil, false
	}
	for _, a := range addrs {
		p := t.byAddr[a]
		e := pinElem{addr: a, ttl: expires.Sub(now), intercept: intercept}
		if p != nil {
			if p.expires.After(expires) {
				e.ttl = p.expires.Sub(now)
			}
			e.intercept = intercept || p.intercept
			if p.expires.Sub(now) > time.Second {
				old := pinElem{addr: a, intercept: p.intercept}
				present = append(present, old)
			}
		}
		add = append(add, e)
	}
	return add, present, true
}

// commit records a planned update.
func (t *pinTable) commit(name string, add []pinElem, now time.Time) {
	for _, e := range add {
		p := t.byAddr[e.addr]
		if p == nil {
			p = &pin{names: map[string]bool{}}
			t.byAddr[e.addr] = p
		}
		p.names[name] = true
		p.expires = now.Add(e.ttl)
		p.intercept = e.intercept
	}
}

// retain computes the pins a new policy keeps: names it still allows (keep), with
// intercept recomputed. The table is not changed until commitRetain.
func (t *pinTable) retain(now time.Time, decide func(name string) (keep, intercept bool)) []pinElem {
	var out []pinElem
	for a, p := range t.byAddr {
		if !now.Before(p.expires) {
			continue
		}
		keep, icpt := false, false
		for n := range p.names {
			k, i := decide(n)
			keep = keep || k
			icpt = icpt || (k && i)
		}
		if keep {
			out = append(out, pinElem{addr: a, ttl: p.expires.Sub(now), intercept: icpt})
		}
	}
	return out
}

// commitRetain makes the table hold exactly kept (names the policy dropped go too,
// lazily: a kept address keeps all its names, which are re-checked at use).
func (t *pinTable) commitRetain(kept []pinElem) {
	next := make(map[netip.Addr]*pin, len(kept))
	for _, e := range kept {
		if p := t.byAddr[e.addr]; p != nil {
			p.intercept = e.intercept
			next[e.addr] = p
		}
	}
	t.byAddr = next
}
