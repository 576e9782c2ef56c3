"""The playground page in headless chromium against a scripted API (no model): what it does
when a request fails (an error status, an in-band error event, a stream cut short), what it
records when the controls move during a run, how the Store tab and the Ask view page through
the stored documents, what it says of a key no HTTP header can carry, that it works under a
path prefix, its tabs, names and live regions for assistive technology, the headers of
everything under ``/playground``, and the page's file and folder redirected to the page. The
API's shapes are the real server's (``responses.py``, ``usage.py``)."""

from __future__ import annotations

import asyncio
import math
import json
import re

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from kvblend.server.playground import CSP, add_playground
from tests.server.browser import headless_chromium, wait_for
from tests.server.helpers import uvicorn_thread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Script:
    """How the fake API answers the next chat requests, per method ("blend", "full"): the
    answer's words, a delay between them, and how it ends ("ok", an HTTP status, "inband"
    for an error event, "cut" for a body that stops before the last chunk)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.answers = {"blend": "Paris .", "full": "Paris ."}
        # each answer token's top logprobs: the sampled word, then "x" (a chat's logprobs=true)
        self.top = {"blend": (0.9, 0.1), "full": (0.8, 0.2)}
        self.ends = {"blend": "ok", "full": "ok"}
        self.delay_s = 0.0
        self.received: list[dict] = []
        self.documents: list[str] = []  # stored ids, in order
        self.listed: list[dict] = []  # the query of every GET /v1/documents


def kvblend_block(method: str, options: dict) -> dict:
    ratio = 1.0 if method == "full" else float(options.get("ratio", 0.2))
    block = {"method": method, "prefix_hit_tokens": 0, "documents": [{"index": 0, "tokens": 4, "source": "memory"}],
             "doc_hits": {} if method == "full" else {"memory": 1}, "doc_misses": 0, "recompute_fraction": ratio,
             "queue_s": 0.0, "lookup_s": 0.0, "load_s": 0.0, "prefill_s": 0.01, "ttft_s": 0.02 if method == "full" else 0.01}
    if method == "blend":
        block["strategy"] = "q+budget+sinks4+shift"
        block.update(risk=0.125, escalated=True)
    if options.get("explain"):
        block["explain"] = {"selection": "question", "score": "question attention", "deviation": "V deviation at layer 1",
                            "sinks": 4, "checks": [], "limits": {"document_tokens": 512, "total_tokens": 4096},
                            "truncated": False, "documents": [
                                {"index": 0, "origin": 0, "offset": 0, "n_tokens": 4, "source": "memory",
                                 "tokens": ["Paris", " is", " in", " France"], "truncated": False, "kept": 1,
                                 "selected": {"positions": [0], "scores": [0.5], "by": ["sink"]},
                                 "reused": {"positions": [1, 2, 3], "scores": [0.1, 0.1, 0.1]},
                                 "deviation": {"positions": [], "values": []}},
                                {"index": 1, "origin": 0, "offset": 4, "n_tokens": 2, "source": "memory",
                                 "tokens": [" in", " Europe"], "truncated": False, "kept": 1,
                                 "selected": {"positions": [1], "scores": [0.25], "by": ["question pass"]},
                                 "reused": {"positions": [0], "scores": [0.1]},
                                 "deviation": {"positions": [], "values": []}}]}
    return block


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def fake_api(script: Script) -> FastAPI:
    app = FastAPI()
    add_playground(app)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/v1/documents")
    async def documents(request: Request, limit: int = 100, after: str = "") -> dict:
        script.listed.append(dict(request.query_params))
        ids = [i for i in script.documents if i > after][:limit + 1]
        page = [{"id": i, "object": "document", "tokens": 4, "num_chunks": 1, "created": 0} for i in ids[:limit]]
        return {"object": "list", "data": page, "has_more": len(ids) > limit,
                "last_id": page[-1]["id"] if page else None}

    @app.get("/v1/kvblend/store")
    async def store() -> dict:
        own = {"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "layer_hits": 0, "layer_misses": 0, "evictions": 0,
               "hit_rate": None}
        return {"object": "kvblend.store", "documents": {"count": len(script.documents), "tokens": 0, "chunks": 0},
                "tiers": [{"name": "memory", "capacity_bytes": None, "used_bytes": 0, "used_entries": 0,
                           "tenant": own}],
                "lookups": own, "tenant_bytes_cap": None}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):  # noqa: ANN202 - JSON or SSE
        options = body.get("kvblend") or {}
        method = options.get("method", "blend")
        if not body.get("stream"):  # the page's warm-up request
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "P"}}],
                    "kvblend": kvblend_block(method, options)}
        script.received.append(body)
        end = script.ends[method]
        if isinstance(end, int):
            return JSONResponse({"error": {"message": "too many requests, retry later", "type": "rate_limit",
                                           "param": None, "code": end}}, status_code=end)
        words = script.answers[method].split(" ")

        async def lines():
            base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "fake-model"}
            yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
            for i, word in enumerate(words):
                await asyncio.sleep(script.delay_s)
                text = word if i == 0 else " " + word
                last = i == len(words) - 1
                if last and end == "cut":
                    return
                if last and end == "inband":
                    yield sse({"error": {"message": "the worker failed", "type": "server_error", "param": None,
                                         "code": 500}})
                    yield sse("[DONE]")
                    return
                chunk = {**base, "choices": [{"index": 0, "delta": {"content": text},
                                              "finish_reason": "stop" if last else None}], "usage": None}
                if body.get("logprobs"):
                    p, q = script.top[method]
                    top = [{"token": text, "logprob": math.log(p), "bytes": list(text.encode())},
                           {"token": "x", "logprob": math.log(q), "bytes": [120]}][: body.get("top_logprobs") or 0]
                    chunk["choices"][0]["logprobs"] = {"content": [{**top[0], "top_logprobs": top}]}
                if last:
                    chunk["kvblend"] = kvblend_block(method, options)
                yield sse(chunk)
            usage = {"prompt_tokens": 20, "completion_tokens": len(words), "total_tokens": 20 + len(words),
                     "prompt_tokens_details": {"cached_tokens": 0 if method == "full" else 4}}
            block = kvblend_block(method, {**options, "explain": False})
            yield sse({**base, "choices": [], "usage": usage, "kvblend": block})
            yield sse("[DONE]")

        return StreamingResponse(lines(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def url(script):
    with uvicorn_thread(fake_api(script), start_timeout_s=30) as base:
        yield base


@pytest.fixture(scope="module")
def prefixed_url(script):
    """The fake API as a reverse proxy shows it under a path prefix: nothing answers outside it."""
    outer = FastAPI()
    outer.mount("/prefix", fake_api(script))
    with uvicorn_thread(outer, start_timeout_s=30) as base:
        yield base + "/prefix"


@pytest.fixture(scope="module")
def driver():
    browser = headless_chromium()
    yield browser
    browser.quit()


@pytest.fixture
def page(url, script, driver):
    """The page freshly loaded, its documents and question filled in, without the warm-up."""
    script.reset()
    driver.get(url + "/")
    wait_for(driver, lambda d: "fake-model" in text(d, "#model"), timeout=20)
    driver.find_element(By.CSS_SELECTOR, "#docs textarea").send_keys("Paris is in France")
    driver.find_element(By.ID, "question").send_keys("Where is Paris?")
    driver.find_element(By.ID, "warm").click()
    return driver


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def banner(driver) -> str:
    el = driver.find_element(By.ID, "banner")
    return el.text if el.is_displayed() else ""


def run(driver) -> str:
    """Click Run and wait for the run to end: the banner's text ("" when it succeeded)."""
    before = driver.execute_script("return state.finished")
    driver.find_element(By.ID, "run").click()
    wait_for(driver, lambda d: d.find_element(By.ID, "run").is_enabled()
             and (d.execute_script("return state.finished") > before or banner(d)), timeout=20)
    return banner(driver)


def test_a_run_shows_both_answers_and_their_numbers(page, script) -> None:
    assert run(page) == ""
    assert text(page, "#answer-blend [data-field=text]") == "Paris ."
    assert text(page, "#answer-blend [data-field=recompute]").startswith("20.0 %")
    assert text(page, "#answer-blend [data-field=cached]") == "4 of 20"
    assert text(page, "#answer-blend [data-field=risk]") == \
        "0.125 of plain reuse's error left · escalated: recomputed again at twice the ratio"
    assert text(page, "#answer-full [data-field=risk]") == "none: no KV reused"
    sent = [b for b in script.received[-2:]]
    assert all(b["logprobs"] is True and b["top_logprobs"] == 20 for b in sent)
    kl = 0.8 * math.log(0.8 / 0.9) + 0.2 * math.log(0.2 / 0.1)  # KL(full || blend) at each of the 2 tokens
    assert text(page, "#answer-blend [data-field=kl]") == f"{kl:.4f} · {kl:.4f} (mean {kl:.4f} over 2 tokens)"


def test_the_kl_per_token_stops_where_the_answers_part(page, script) -> None:
    script.answers["full"] = "Lyon is it"  # parts at the first token: only that position is the same context
    try:
        assert run(page) == ""
        kl = 0.8 * math.log(0.8 / 0.1) + 0.2 * math.log(0.2 / 0.1)  # "Lyon" is not in the blend's list: its lowest
        assert text(page, "#answer-blend [data-field=kl]") == f"{kl:.4f} (mean {kl:.4f} over 1 token)"
    finally:
        script.reset()
    assert page.find_elements(By.CSS_SELECTOR, "#doc-views .tok.kept")


def test_a_stream_cut_short_is_reported_as_such(page, script) -> None:
    script.ends["blend"] = "cut"
    message = run(page)
    assert "ended before" in message and "null" not in message, message


def test_an_in_band_error_is_shown(page, script) -> None:
    script.ends["full"] = "inband"
    assert "Error 500: the worker failed" in run(page)


def test_the_ratio_and_strategy_recorded_are_those_the_run_sent(page, script) -> None:
    script.delay_s = 0.4  # the controls move while the blend streams
    before = page.execute_script("return state.finished")
    page.find_element(By.ID, "run").click()
    page.find_element(By.ID, "ratio").send_keys(*[Keys.ARROW_RIGHT] * 4)
    page.find_element(By.ID, "strategy").send_keys(Keys.ARROW_DOWN)
    assert page.find_element(By.ID, "strategy").get_attribute("value") == "cacheblend"
    wait_for(page, lambda d: d.execute_script("return state.finished") > before or banner(d), timeout=20)
    assert banner(page) == ""
    sent = [r["kvblend"] for r in script.received if r["kvblend"]["method"] == "blend"]
    assert sent == [{"method": "blend", "ratio": 0.2, "explain": True}]
    assert page.execute_script("return state.runs.map((r) => [r.ratio, r.strategy])") == [[0.2, "blend"]]


def test_a_failed_run_leaves_nothing_of_the_run_before(page, script) -> None:
    assert run(page) == ""
    assert text(page, "#answer-full [data-field=text]") == "Paris ."
    script.answers["blend"], script.ends["full"] = "Lyon .", 429
    assert "Error 429: too many requests" in run(page)
    assert text(page, "#answer-blend [data-field=text]") == "Lyon ."
    for shown in ("#answer-full [data-field=text]", "#answer-full [data-field=ttft]", "#agreement"):
        assert "Paris" not in text(page, shown) and "ms" not in text(page, shown), shown
    script.ends["blend"] = 503
    assert "Error 503" in run(page)
    assert text(page, "#answer-blend [data-field=text]") not in ("…", "Lyon ."), "a run that failed still shows as running"


@pytest.mark.parametrize("path", ["/", "/playground/playground.js", "/playground/playground.css"])
def test_every_file_of_the_page_has_its_headers(url, path) -> None:
    res = httpx.get(url + path)
    assert res.status_code == 200
    assert res.headers["content-security-policy"] == CSP
    assert res.headers["x-content-type-options"] == "nosniff"
    assert res.headers["cache-control"] == "no-cache"  # an upgrade's script is not mixed with an old page


@pytest.mark.parametrize(("path", "location"), [("/playground/index.html", "../"), ("/playground/", "../"),
                                                 ("/playground", "./")])
def test_the_page_file_and_its_folder_redirect_to_the_page(url, path, location) -> None:
    """``/playground/index.html`` served the page where its relative URLs name nothing
    (``playground/playground.js`` under ``/playground/``): no script, no API. Redirected to
    the page instead, by a relative URL that keeps a reverse proxy's prefix, with the page's
    headers (nothing there may be framed)."""
    res = httpx.get(url + path)
    assert res.status_code == 308 and res.headers["location"] == location, (res.status_code, res.headers)
    assert res.headers["content-security-policy"] == CSP


def test_the_page_opened_by_its_file_name_under_a_path_prefix_works(prefixed_url, script, driver) -> None:
    script.reset()
    driver.get(prefixed_url + "/playground/index.html")
    wait_for(driver, lambda d: "fake-model" in text(d, "#model"), timeout=20)  # its script ran, /v1/models answered
    assert driver.current_url == prefixed_url + "/"


def test_the_upload_can_be_reached_by_keyboard(page) -> None:
    page.find_element(By.ID, "save-docs").send_keys(Keys.TAB)
    assert page.execute_script("return document.activeElement.id") == "upload"


def test_a_token_of_a_later_chunk_is_named_by_its_place_in_the_document(page) -> None:
    assert run(page) == ""
    (view,) = page.find_elements(By.CSS_SELECTOR, "#doc-views .docview")  # one document in two chunks
    assert view.find_element(By.CSS_SELECTOR, ".tokens").text == "Paris is in France in Europe"
    titles = [t.get_attribute("title") for t in view.find_elements(By.CSS_SELECTOR, ".tok")]
    assert [t.split(" · ")[0] for t in titles] == [f"token {i}" for i in range(6)]
    assert "2 of 6 tokens recomputed" in view.text


def test_a_long_run_can_be_stopped(page, script) -> None:
    script.answers["blend"] = " ".join(["word"] * 60)
    script.delay_s = 0.5  # 30 s of answer
    page.find_element(By.ID, "run").click()
    wait_for(page, lambda d: "word" in text(d, "#answer-blend [data-field=text]"), timeout=10)
    page.find_element(By.ID, "stop").click()
    wait_for(page, lambda d: d.find_element(By.ID, "run").is_enabled(), timeout=3)
    assert banner(page) == "" and text(page, "#status") == "stopped"
    assert not page.find_element(By.ID, "stop").is_displayed()
    assert [r["kvblend"]["method"] for r in script.received] == ["blend"]  # full prefill never started


def store_rows(driver) -> list[str]:
    """The first cell of each row in the Store tab's documents table (read at once: rows are replaced)."""
    return driver.execute_script("return [...document.querySelectorAll('#store-docs tbody tr')]"
                                 ".map((tr) => tr.cells[0].textContent)")


def page_through(page, script, more_id: str, shown_now) -> None:
    """Click ``more_id`` until all of ``script.documents`` (250) are shown (``shown_now``
    reads them), checking the button is shown exactly while pages are left: every document
    once, in order, a page of at most 100 at a time."""
    more = page.find_element(By.ID, more_id)
    for shown in (100, 200, 250):
        wait_for(page, lambda d: len(shown_now(d)) == shown, timeout=10)
        wait_for(page, lambda d: more.is_displayed() == (shown < 250) and more.is_enabled(), timeout=10)
        if shown < 250:
            more.click()
    assert shown_now(page) == script.documents  # in order, none twice
    assert all(int(q["limit"]) <= 100 for q in script.listed)  # a page at a time, never all at once


def test_the_store_tab_pages_through_every_document(page, script) -> None:
    script.documents = [f"doc-{i:03d}" for i in range(250)]
    page.find_element(By.CSS_SELECTOR, "[data-view=store]").click()
    more = page.find_element(By.ID, "more-docs")
    page_through(page, script, "more-docs", store_rows)
    assert banner(page) == ""
    page.find_element(By.ID, "refresh-store").click()  # a refresh starts again from the first page
    wait_for(page, lambda d: len(store_rows(d)) == 100 and more.is_displayed(), timeout=10)


def stored_choices(driver) -> list[str]:
    """The Ask view's stored documents offered (the values of the select's options but its prompt)."""
    return driver.execute_script("return [...document.querySelectorAll('#stored option')].slice(1)"
                                 ".map((o) => o.value)")


def test_the_ask_view_pages_through_every_stored_document(page, script) -> None:
    """The Ask view offered only the first 100 stored documents: it pages as the Store tab does."""
    script.documents = [f"doc-{i:03d}" for i in range(250)]
    page.find_element(By.ID, "key-form").submit()  # connects again: the stored documents listed anew
    page_through(page, script, "more-stored", stored_choices)
    more = page.find_element(By.ID, "more-stored")
    assert [q.get("after") for q in script.listed[-3:]] == [None, "doc-099", "doc-199"]
    Select(page.find_element(By.ID, "stored")).select_by_value("doc-249")  # one only a later page held
    assert text(page, "#docs .stored .name") == "stored: doc-249 (4 tokens)"
    assert banner(page) == ""
    page.find_element(By.ID, "key-form").submit()  # listed anew: from the first page again
    wait_for(page, lambda d: len(stored_choices(d)) == 100 and more.is_displayed(), timeout=10)


def test_a_key_no_http_header_can_carry_is_named_before_anything_is_sent(page, script) -> None:
    """fetch throws a TypeError naming no field for a header value outside ISO-8859-1."""
    try:
        page.find_element(By.ID, "api-key").send_keys("ключ-0001", Keys.ENTER)
        message = wait_for(page, banner, timeout=10)
        assert "API key field" in message and "fetch" not in message, message
        assert "API key field" in run(page)
        assert script.received == []
    finally:
        page.find_element(By.ID, "forget-key").click()
    wait_for(page, lambda d: banner(d) == "" and "fake-model" in text(d, "#model"), timeout=10)


def test_the_page_works_under_a_path_prefix(prefixed_url, script, driver) -> None:
    script.reset()
    driver.get(prefixed_url + "/")
    wait_for(driver, lambda d: "fake-model" in text(d, "#model"), timeout=20)  # its script and /v1/models
    driver.find_element(By.CSS_SELECTOR, "#docs textarea").send_keys("Paris is in France")
    driver.find_element(By.ID, "question").send_keys("Where is Paris?")
    assert run(driver) == ""  # the warm-up and both streams
    driver.find_element(By.CSS_SELECTOR, "[data-view=store]").click()
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#store-tiers tbody tr"), timeout=10)
    driver.find_element(By.CSS_SELECTOR, "[data-view=ask]").click()
    urls = driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    urls = [u for u in urls if not u.endswith("/favicon.ico")]  # the browser's own guess, not the page's
    names = {u.rsplit("/", 1)[1] for u in urls}
    assert names >= {"playground.css", "playground.js", "models", "completions", "store"}, urls
    assert all(u.startswith(prefixed_url + "/") for u in urls), urls


def test_the_views_are_tabs_for_assistive_technology(page) -> None:
    """The WAI-ARIA tabs pattern: a tablist of tabs, each selecting the tabpanel it controls."""
    assert page.find_element(By.CSS_SELECTOR, "nav").aria_role == "tablist"
    tabs = page.find_elements(By.CSS_SELECTOR, "[data-view]")
    assert [t.aria_role for t in tabs] == ["tab", "tab"]

    def selected() -> list[str]:
        out = []
        for tab in tabs:
            panel = page.find_element(By.ID, tab.get_attribute("aria-controls"))
            out.append(tab.get_attribute("aria-selected"))
            assert panel.is_displayed() == (out[-1] == "true")
            if panel.is_displayed():  # a hidden one is out of the accessibility tree
                assert panel.aria_role == "tabpanel" and panel.accessible_name == tab.accessible_name
        return out

    assert selected() == ["true", "false"]
    tabs[1].click()
    assert selected() == ["false", "true"]
    tabs[1].send_keys(Keys.ARROW_LEFT)  # the arrow keys move between the tabs, one Tab stop for them all
    assert selected() == ["true", "false"]
    assert page.execute_script("return document.activeElement.dataset.view") == "ask"
    assert [t.get_attribute("tabindex") for t in tabs] == ["0", "-1"]


def test_every_control_has_a_name(page) -> None:
    """Each input, select, textarea and button of the Ask view is named in words (a placeholder or
    a "×" is not a name)."""
    controls = page.execute_script("return [...document.querySelectorAll('input, select, textarea, button')]"
                                   ".filter((el) => !el.closest('[hidden]'))")
    unnamed = [c.get_attribute("outerHTML")[:80] for c in controls
               if not re.search(r"[A-Za-z]{2}", c.accessible_name)
               or c.accessible_name == c.get_attribute("placeholder")]
    assert len(controls) > 15 and unnamed == [], unnamed


def test_the_status_and_the_answers_are_live_regions(page, script) -> None:
    assert page.find_element(By.ID, "status").aria_role == "status"
    answers = page.find_elements(By.CSS_SELECTOR, "#answers [data-field=text]")
    assert [a.get_attribute("aria-live") for a in answers] == ["polite", "polite"]
    script.delay_s = 0.3  # busy while it streams: read out once whole, not at every token
    page.find_element(By.ID, "run").click()
    wait_for(page, lambda d: answers[0].get_attribute("aria-busy") == "true", timeout=10)
    wait_for(page, lambda d: d.find_element(By.ID, "run").is_enabled(), timeout=20)
    assert banner(page) == "" and [a.get_attribute("aria-busy") for a in answers] == ["false", "false"]
