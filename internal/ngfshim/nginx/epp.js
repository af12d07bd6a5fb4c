// The NJS side of NGINX Gateway Fabric's endpoint picking, as NGF's
// internal/controller/nginx/modules/src/epp.js does it: a js_content handler
// that sends the client's method, headers and body to the shim (ngx.fetch),
// with X-EPP-Host and X-EPP-Port naming the picker, stores the endpoint the
// shim answers with in $inference_workload_endpoint, and redirects
// internally to $epp_internal_path, whose location proxies the request.
//
// As in NGF, a shim answer other than 200 with an endpoint is logged and
// otherwise dropped: the variable stays empty and the NGINX map applies the
// pool's failure mode. The client never sees the picker's status.
//
// Two differences: NGF's shim address is a constant (127.0.0.1:54800); here
// it comes from $epp_shim_addr so that tests can run shims on free ports.
// And the log lines name the request (NJS's own lines do not), so a test can
// find its request's.
import qs from 'querystring';

const ENDPOINT_HEADER = 'X-Gateway-Destination-Endpoint';

async function getEndpoint(r) {
	const v = r.variables;
	// A plain loop: Debian 12's njs (0.7.9) has no for...of.
	const required = ['epp_host', 'epp_port', 'epp_internal_path', 'epp_shim_addr'];
	for (let i = 0; i < required.length; i++) {
		if (!v[required[i]]) {
			throw Error(`the location must set $${required[i]}`);
		}
	}

	const headers = Object.assign({}, r.headersIn);
	headers['X-EPP-Host'] = v.epp_host;
	headers['X-EPP-Port'] = v.epp_port;

	try {
		const resp = await ngx.fetch(`http://${v.epp_shim_addr}`, {
			method: r.method,
			headers: headers,
			body: r.requestText,
		});
		const endpoint = resp.headers.get(ENDPOINT_HEADER);
		if (resp.status === 200 && endpoint) {
			v.inference_workload_endpoint = endpoint;
			r.log(`endpoint picker chose ${endpoint} for ${r.method} ${v.request_uri}`);
		} else {
			// Trimmed so that the log entry stays on one line (the shim's
			// error bodies end with a newline).
			const body = (await resp.text()).trim();
			r.error(`endpoint picker gave no endpoint for ${r.method} ${v.request_uri}: shim status: ${resp.status}; body: ${body}`);
		}
	} catch (e) {
		r.error(`asking the endpoint picker shim failed for ${r.method} ${v.request_uri}: ${e}`);
	}

	// The internal location proxies $request_uri, but a rewrite would drop
	// the query: keep it on the redirect, as NGF does.
	let args = qs.stringify(r.args);
	if (args) {
		args = '?' + args;
	}
	r.internalRedirect(v.epp_internal_path + args);
}

export default { getEndpoint };
