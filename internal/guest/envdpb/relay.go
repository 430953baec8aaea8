package envdpb

// How space relays envd traffic from its E2B gateway (internal/e2b) to space-agent,
// which serves envd under Prefix. Both sides import these names.
const (
	// Prefix is the agent path under which envd is served.
	Prefix = "/envd"
	// Version is the envd version the agent implements; the E2B SDKs enable features
	// by it (0.6.13 has everything they use: stdin control, close stdin,
	// octet-stream and gzip uploads, file metadata, watch entries).
	Version = "0.6.13"
	// AuthHeader carries the SDK's Authorization header (Basic auth naming the user)
	// past the proxies in between, which use Authorization themselves.
	AuthHeader = "X-Envd-Authorization"
	// AcceptEncodingHeader carries the SDK's own Accept-Encoding: the HTTP transports
	// between gateway and agent add gzip on their own and undo it again.
	AcceptEncodingHeader = "X-Envd-Accept-Encoding"
	// TunnelHeader asks the agent to answer with status 200 and to put the real status
	// in StatusHeader: the proxies in between turn error statuses into errors of their
	// own, and the SDKs need envd's own error bodies. The gateway restores the status.
	TunnelHeader = "X-Space-Status-Tunnel"
	StatusHeader = "X-Space-Status"
	// Port is envd's port in E2B's routing (E2b-Sandbox-Port, <port>-<id>.<domain>).
	Port = 49983
)
